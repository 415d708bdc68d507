"""edge_client.drafting.grammar: the draft masks its own logits with the session's grammar and drafts forced
tokens without a forward pass (the tiny ONNX draft, the real SmolLM2 tokenizer)."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest

from specdec_runtime.common.grammar import GrammarSpec, compile_grammar, grammar_tokenizer
from specdec_runtime.common.types import SamplingParams
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.grammar import DraftGrammar, propose_constrained
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0, "maximum": 99},
    "label": {"type": "string", "maxLength": 4}}, "required": ["color", "size", "label"],
    "additionalProperties": False}


@pytest.fixture(scope="module")
def draft(tiny_pair):
    return OnnxDraftModel(tiny_pair.draft_dir)


@pytest.fixture(scope="module")
def compiled(draft):
    return compile_grammar(GrammarSpec.json_schema(SCHEMA), grammar_tokenizer(draft.tokenizer, [2]))


class CountingModel:
    """The real draft model, its forward passes counted."""

    def __init__(self, model):
        self._model, self.forwards = model, 0

    def forward(self, ids):
        self.forwards += 1
        return self._model.forward(ids)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _reference_greedy(draft, compiled, prompt, n):
    """Masked argmax from a full-prefix forward pass at every position (no KV reuse, no forced shortcut)."""
    m = compiled.matcher()
    out = []
    for _ in range(n):
        draft.reset()
        logits = np.array(draft.forward(prompt + out)[-1], dtype=np.float32)
        allowed = m.mask(len(logits))
        logits[~allowed] = -np.inf
        t = int(np.argmax(logits))
        out.append(t)
        m.advance([t])
        if t == 2:
            break
    draft.reset()
    return out


def _run(drafter, grammar, prompt, total, gamma, sampling, seed=0):
    committed, forced, blocks = list(prompt), 0, []
    while len(committed) - len(prompt) < total:
        seeded = dataclasses.replace(sampling, seed=seed)
        block = propose_constrained(drafter, grammar, committed, gamma, seeded, 0.0, None, 0.0)
        if not block.draft_token_ids:
            break
        blocks.append(block)
        forced += grammar.last_num_forced
        committed += block.draft_token_ids  # as if all accepted
        if committed[-1] == 2:
            break
    return committed[len(prompt):], forced, blocks


def test_greedy_constrained_draft_equals_masked_argmax_and_forced_tokens_are_free(draft, compiled):
    prompt = draft.tokenizer.encode("Describe a ball as JSON:", add_special_tokens=False)
    ref = _reference_greedy(draft, compiled, prompt, 40)
    model = CountingModel(draft)
    drafter = ModelDrafter(model)
    grammar = DraftGrammar(compiled, len(prompt))
    out, forced, blocks = _run(drafter, grammar, prompt, 40, 5, SamplingParams())
    assert out == ref[:len(out)] and len(out) >= 10
    assert forced >= 4  # '{"', 'color', '":', ... forced by the schema
    # one forward pass per unforced position (the forced runs are fed with the next one), none per forced one
    assert model.forwards <= len(out) - forced + len(blocks)
    checker = compiled.matcher()
    for t in out:
        assert checker.mask()[t]
        checker.advance([t])


def test_sampled_constrained_draft_q_rows(draft, compiled):
    prompt = draft.tokenizer.encode("JSON please:", add_special_tokens=False)
    drafter = ModelDrafter(draft, draft_top_k=8)
    grammar = DraftGrammar(compiled, len(prompt))
    out, forced, blocks = _run(drafter, grammar, prompt, 30, 4, SamplingParams(temperature=1.0), seed=7)
    checker = compiled.matcher()
    n_one_hot = 0
    for block in blocks:
        q = block.draft_probs
        assert q is not None and q.token_ids.shape[0] == len(block.draft_token_ids)
        for i, t in enumerate(block.draft_token_ids):
            row = dict(zip(q.token_ids[i].tolist(), q.probs[i].tolist()))
            assert row[t] > 0  # the token is in the support of the q it was drawn from
            mask = checker.mask()
            assert all(mask[j] for j, p in row.items() if p > 0)  # q never puts mass outside the grammar
            if np.count_nonzero(mask) == 1:
                assert row[t] == pytest.approx(1.0)
                n_one_hot += 1
            checker.advance([t])
    assert n_one_hot == forced > 0


def test_prefix_the_grammar_forbids_gives_an_empty_block(draft, compiled):
    prompt = draft.tokenizer.encode("x", add_special_tokens=False)
    grammar = DraftGrammar(compiled, len(prompt))
    bad = prompt + draft.tokenizer.encode("nope", add_special_tokens=False)
    block = propose_constrained(ModelDrafter(draft), grammar, bad, 4, SamplingParams(), 0.0, None, 0.0)
    assert block.draft_token_ids == []


def test_nothing_is_drafted_after_eos(draft):
    # a proactive bet can end with the EOS of a complete answer: the next block is empty, not an error
    compiled = compile_grammar(GrammarSpec.choice(["yes", "no"]), grammar_tokenizer(draft.tokenizer, [2]))
    prompt = draft.tokenizer.encode("x", add_special_tokens=False)
    done = prompt + draft.tokenizer.encode("yes", add_special_tokens=False) + [2]
    block = propose_constrained(ModelDrafter(draft), DraftGrammar(compiled, len(prompt)), done, 4, SamplingParams(),
                                0.0, None, 0.0)
    assert block.draft_token_ids == []


def test_constrained_draft_applies_the_history_processors(draft):
    """The draft's processors (here logit_bias) run after the grammar mask, as on the verifier: a bias of -100 on
    the token the masked draft would pick moves its argmax to the other answer's first token."""
    compiled = compile_grammar(GrammarSpec.choice(["yes", "no"]), grammar_tokenizer(draft.tokenizer, [2]))
    prompt = draft.tokenizer.encode("Answer:", add_special_tokens=False)
    drafter = ModelDrafter(draft)
    plain = propose_constrained(drafter, DraftGrammar(compiled, len(prompt)), prompt, 1, SamplingParams(), 0.0,
                                None, 0.0).draft_token_ids
    biased = propose_constrained(drafter, DraftGrammar(compiled, len(prompt)), prompt, 1,
                                 SamplingParams(logit_bias={plain[0]: -100.0}), 0.0, None, 0.0).draft_token_ids
    assert len(plain) == len(biased) == 1 and biased != plain
    assert compiled.matcher().mask()[biased[0]]  # still an id the grammar allows
