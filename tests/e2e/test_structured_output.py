"""Structured output under speculation, end to end (in-process verifier, tiny pair): greedy speculative decoding
with a grammar is token-identical to target-only decoding with the same grammar (an HF reference masked by
common.grammar, and the client's --target-only path), every output parses and validates (jsonschema); a draft
token the grammar forbids is rejected by the rule; forced tokens are counted; a bad schema is refused at
OpenSession with the engine's message."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.grammar import GrammarSpec, compile_grammar, grammar_tokenizer
from specdec_runtime.common.types import DraftBlock, FinishReason
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import LocalBackend

EOS = 2
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                      "address": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 4},
                                          "zip": {"type": "integer", "minimum": 0, "maximum": 999}},
                                          "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "address"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "cd"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -50, "maximum": 50},
                                      "xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}, "maxItems": 2}},
     "required": ["n", "xs"], "additionalProperties": False},
]
PROMPTS = ["Give me JSON.", "Describe a city.", "A user record:", "Numbers please", "Reply in JSON only."]
MAX_NEW = 80


@pytest.fixture(scope="module")
def tiny_verifier(tiny_pair):
    backend = LocalBackend(Verifier(TargetRunner(tiny_pair.target_dir), max_num_speculative_tokens=8))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    return AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return OnnxDraftModel(tiny_pair.draft_dir).tokenizer


class GrammarLogitsProcessor:
    """An HF logits processor masking with common.grammar (the matcher synced to the generated ids)."""

    def __init__(self, compiled, prompt_length):
        self.matcher, self.prompt_length = compiled.matcher(), prompt_length

    def __call__(self, input_ids, scores):
        self.matcher.sync(input_ids[0, self.prompt_length:].tolist())
        allowed = torch.from_numpy(self.matcher.mask(scores.shape[-1]))
        return scores.masked_fill(~allowed, float("-inf"))


def masked_greedy(model, tokenizer, prompt_ids, spec, max_new):
    """Target-only constrained greedy decoding, independent of the verifier: HF generate() with the ids
    common.grammar forbids at -inf; ends with EOS."""
    from transformers import LogitsProcessorList

    compiled = compile_grammar(spec, grammar_tokenizer(tokenizer, [EOS]))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS,
                             pad_token_id=EOS,
                             logits_processor=LogitsProcessorList([GrammarLogitsProcessor(compiled, len(prompt_ids))]))
    return out[0, len(prompt_ids):].tolist()


def client_for(backend, draft_dir, gamma=4):
    model = OnnxDraftModel(draft_dir)
    return EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=gamma)


@pytest.mark.parametrize("schema_index", range(len(SCHEMAS)))
def test_greedy_schema_constrained_equals_target_only_and_validates(tiny_pair, tiny_verifier, hf_target, tokenizer,
                                                                    schema_index):
    schema = SCHEMAS[schema_index]
    spec = GrammarSpec.json_schema(schema)
    spec_client = client_for(tiny_verifier, tiny_pair.draft_dir)
    low_client = client_for(tiny_verifier, tiny_pair.other_draft_dir, gamma=3)  # low acceptance: many rejections
    target_only = EdgeClient(tiny_verifier, None, tokenizer)
    forced = 0
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        ref = masked_greedy(hf_target, tokenizer, ids, spec, MAX_NEW)
        assert ref[-1] == EOS, "the reference must finish within MAX_NEW"
        for client in (spec_client, low_client, target_only):
            res = client.generate(ids, max_new_tokens=MAX_NEW, grammar=spec)
            assert res.token_ids == ref[:-1] or res.token_ids == ref, (prompt, client.drafter)
            assert res.finish_reason == FinishReason.EOS
            jsonschema.validate(json.loads(res.text), schema)
        forced += spec_client.last_result.stats.num_forced_tokens
        assert spec_client.last_result.to_json()["num_forced_tokens"] == spec_client.last_result.stats.num_forced_tokens
    assert forced > 0  # key names and punctuation are forced and drafted for free


class ForbiddenDrafter:
    """Proposes a token the grammar never allows at the start of a JSON object ('@'), q one-hot."""

    def __init__(self, token_id):
        self.token_id = token_id
        self.proposed = 0

    def propose(self, committed, gamma, sampling, min_confidence=0.0, should_stop=None):
        self.proposed += gamma
        if sampling.greedy:
            return DraftBlock([self.token_id] * gamma)
        from specdec_runtime.common.types import SparseDraftProbs

        return DraftBlock([self.token_id] * gamma, SparseDraftProbs(np.full((gamma, 1), self.token_id, np.int64),
                                                                   np.ones((gamma, 1), np.float32)))

    def reset(self) -> None:  # Resettable (a seeded sampled session needs it): it keeps nothing to forget
        pass


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_token_the_grammar_forbids_is_rejected_by_the_rule(tiny_verifier, tokenizer, temperature):
    spec = GrammarSpec.choice(["yes", "no"])
    at = tokenizer.encode("@", add_special_tokens=False)[0]
    drafter = ForbiddenDrafter(at)
    client = EdgeClient(tiny_verifier, drafter, tokenizer, num_speculative_tokens=3)
    ids = encode_prompt(tokenizer, "Answer:")
    res = client.generate(ids, max_new_tokens=8, grammar=spec, temperature=temperature, seed=5)
    assert drafter.proposed > 0 and res.stats.num_accepted_tokens == 0
    assert res.text in ("yes", "no") and at not in res.token_ids


def test_invalid_schema_is_refused_at_open_with_the_engines_message(tiny_verifier, tokenizer):
    client = EdgeClient(tiny_verifier, None, tokenizer)
    ids = encode_prompt(tokenizer, "x")
    with pytest.raises(InvalidRequestError, match="frob"):
        client.generate(ids, max_new_tokens=4, grammar=GrammarSpec("json_schema", '{"type": "frob"}'))
    with pytest.raises(InvalidRequestError, match="unclosed group"):
        client.generate(ids, max_new_tokens=4, grammar=GrammarSpec("regex", "a(b"))


CHOICES = ["apple", "apricot", "apex", "banana"]  # 'ap...' paths collide on their first tokens


def _answer_counts(client, tokenizer, seeds, spec):
    ids = encode_prompt(tokenizer, "Pick a fruit.")
    counts: dict[str, int] = {}
    for seed in seeds:
        text = client.generate(ids, max_new_tokens=8, temperature=1.0, seed=seed, grammar=spec).text
        counts[text] = counts.get(text, 0) + 1
    return counts


def _tv(a: dict, b: dict) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))


@pytest.mark.slow  # 19-42 s measured
def test_sampled_choice_distribution_equals_target_only_with_a_negative_control(tiny_pair, tiny_verifier, tokenizer,
                                                                               monkeypatch):
    """Seeded TV test: speculative sampled decoding (a low-acceptance draft, top-k drafting) under a choice grammar
    draws the answers with target-only constrained sampling's law; the verifier without its mask does not."""
    spec = GrammarSpec.choice(CHOICES)
    n = 150
    ref = _answer_counts(EdgeClient(tiny_verifier, None, tokenizer), tokenizer, range(n), spec)
    model = OnnxDraftModel(tiny_pair.other_draft_dir)
    spec_client = EdgeClient(tiny_verifier, ModelDrafter(model, draft_top_k=4), model.tokenizer,
                             num_speculative_tokens=3)
    got = _answer_counts(spec_client, tokenizer, range(10_000, 10_000 + n), spec)
    assert set(ref) <= set(CHOICES) and set(got) <= set(CHOICES)
    assert len(ref) >= 2  # the grammar leaves a real choice to the target's distribution
    assert _tv(ref, got) < 0.15, (ref, got)
    # negative control: the verifier forgets the grammar (p unconstrained); the draft still masks its q
    import specdec_runtime.cloud_verifier.verdict.row_logits as row_logits

    monkeypatch.setattr(row_logits, "apply_session_grammar", lambda session, block, logits: logits)
    broken = _answer_counts(spec_client, tokenizer, range(20_000, 20_000 + n // 3), spec)
    assert _tv(ref, broken) > 0.3, broken
