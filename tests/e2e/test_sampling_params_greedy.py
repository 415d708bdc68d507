"""Every history-dependent sampling parameter, greedy, exact under speculation: speculative decoding (a draft
that agrees with the target, and one that mostly does not) gives the token ids of target-only decoding and of HF
generate() with the equivalent processors (tests/_hf_processors.py), per parameter and all together; and a
negative control: the verifier applying one history to every block position (SGLang's approximation: the
block's earlier draft tokens left out) breaks the equality."""

from __future__ import annotations

import numpy as np
import pytest

import specdec_runtime.cloud_verifier.verdict.row_logits as row_logits
from _hf_processors import hf_greedy_processed
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.types import OpenRequest, SamplingParams
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import LocalBackend

PROMPTS = ["Why is the sky blue?", "List three prime numbers."]
N = 24
EOS = 2  # the tiny pair's eos_token_id

# The tiny random target never repeats itself in N tokens, so penalties alone would change nothing: a bias makes
# four tokens compete, and the penalties then decide which comes next (each setting changes the output).
COMPETE = {100: 6.0, 200: 5.5, 300: 5.0, 400: 4.5}
SETTINGS = {  # name -> (options, the options whose output it must differ from)
    "logit_bias": (dict(logit_bias=COMPETE), {}),
    "repetition_penalty": (dict(logit_bias=COMPETE, repetition_penalty=1.5), dict(logit_bias=COMPETE)),
    "presence_penalty": (dict(logit_bias=COMPETE, presence_penalty=1.0), dict(logit_bias=COMPETE)),
    "frequency_penalty": (dict(logit_bias=COMPETE, frequency_penalty=0.4), dict(logit_bias=COMPETE)),
    "all": (dict(logit_bias=COMPETE, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3),
            dict(logit_bias=COMPETE)),
}


@pytest.fixture(scope="module")
def backend(tiny_pair):
    b = LocalBackend(Verifier(TargetRunner(tiny_pair.target_dir), max_num_speculative_tokens=8))
    yield b
    b.close()


@pytest.fixture(scope="module")
def clients(tiny_pair, backend):
    def spec(draft_dir):
        model = OnnxDraftModel(draft_dir)
        return EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=4)

    target_only = EdgeClient(backend, None, OnnxDraftModel(tiny_pair.draft_dir).tokenizer)
    return {"agree": spec(tiny_pair.draft_dir), "disagree": spec(tiny_pair.other_draft_dir), "target": target_only}


@pytest.fixture(scope="module")
def fixed_agree(tiny_pair):
    """The agreeing draft against a verifier that verifies every drafted position (the negative control's case
    is a block's later rows; an adaptive cut to one position, which timing decides, has none)."""
    b = LocalBackend(Verifier(TargetRunner(tiny_pair.target_dir), max_num_speculative_tokens=8,
                              verify_policy="fixed"))
    model = OnnxDraftModel(tiny_pair.draft_dir)
    yield EdgeClient(b, ModelDrafter(model), model.tokenizer, num_speculative_tokens=4)
    b.close()


def _generate(client, ids, **kw):
    return client.generate(ids, max_new_tokens=N, **kw)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_equals_target_only_and_hf(tiny_pair, clients, name):
    kw, without = SETTINGS[name]
    params = SamplingParams(**kw)
    for prompt in PROMPTS if name == "all" else PROMPTS[:1]:  # all together on every prompt, each alone on one
        ids = encode_prompt(clients["target"].tokenizer, prompt)
        ref = hf_greedy_processed(tiny_pair.target_dir, ids, N, params)
        plain = _generate(clients["target"], ids, ignore_eos=True, **without).token_ids
        assert ref != plain, "the parameter must change the output (else this test proves nothing)"
        assert _generate(clients["target"], ids, ignore_eos=True, **kw).token_ids == ref
        agree = _generate(clients["agree"], ids, ignore_eos=True, **kw)
        assert agree.token_ids == ref
        assert agree.stats.acceptance_rate > 0.8  # the draft applies the same processors: q stays close to p
        assert _generate(clients["disagree"], ids, ignore_eos=True, **kw).token_ids == ref


def test_min_tokens_masks_eos_until_reached(tiny_pair, clients):
    """EOS pushed up by a bias: without min_tokens the generation ends at once; with min_tokens=5 EOS is masked
    for the first 5 tokens and comes as the 6th, as HF's MinNewTokensLengthLogitsProcessor does it."""
    kw = dict(logit_bias={EOS: 30.0})
    ids = encode_prompt(clients["target"].tokenizer, PROMPTS[0])
    assert _generate(clients["target"], ids, **kw).token_ids == [EOS]
    kw["min_tokens"] = 5
    ref = hf_greedy_processed(tiny_pair.target_dir, ids, N, SamplingParams(**kw), eos_token_id=EOS)
    assert len(ref) == 6 and ref[-1] == EOS
    for which in ("target", "agree", "disagree"):
        res = _generate(clients[which], ids, **kw)
        assert res.token_ids == ref, which
        assert res.finish_reason.value == "eos"


def test_penalty_history_without_the_blocks_draft_tokens_breaks_exactness(clients, fixed_agree, monkeypatch):
    """Negative control: every block position penalised with the committed history only (the block's earlier
    draft tokens left out, SGLang's documented approximation) no longer equals target-only decoding."""
    kw = SETTINGS["all"][0]
    ids = encode_prompt(clients["target"].tokenizer, PROMPTS[0])
    ref = _generate(clients["target"], ids, ignore_eos=True, **kw).token_ids

    def same_history_everywhere(history, logits, draft_token_ids):
        for i in range(logits.shape[0]):
            history.apply(logits[i])
        return logits

    monkeypatch.setattr(row_logits, "process_block", same_history_everywhere)
    assert _generate(fixed_agree, ids, ignore_eos=True, **kw).token_ids != ref
    monkeypatch.undo()
    assert _generate(fixed_agree, ids, ignore_eos=True, **kw).token_ids == ref


def test_logit_bias_minus_100_bans_a_token(clients):
    ids = encode_prompt(clients["target"].tokenizer, PROMPTS[1])
    plain = _generate(clients["target"], ids, ignore_eos=True).token_ids
    banned = int(np.bincount(plain).argmax())  # the most frequent token of the plain output
    for which in ("target", "agree"):
        out = _generate(clients[which], ids, ignore_eos=True, logit_bias={banned: -100.0}).token_ids
        assert banned not in out, which


def test_a_conversations_second_turn_rebuilds_the_counts(clients):
    """ExtendSession: the verifier's counts are rebuilt for the new turn (its own output; the whole conversation
    for the repetition penalty), so each turn equals target-only decoding of that turn's prompt."""
    kw = dict(SETTINGS["all"][0], max_new_tokens=N, ignore_eos=True)
    conv = clients["agree"].chat(**kw)
    for message in PROMPTS:
        for _ in conv.send(message):
            pass
        res = conv.last_result
        assert res.token_ids == clients["target"].generate(res.prompt_token_ids, **kw).token_ids
    conv.close()


def test_a_session_lost_mid_generation_keeps_its_output_counts(clients, backend):
    """The verifier loses the session mid-generation (its record gone, as after a store restarted empty): the
    SDK re-opens one over everything committed and says how much of it is output (num_output_tokens), so the
    presence/frequency counts and min_tokens carry on as in the lost session: target-only's token ids."""
    kw = dict(logit_bias={**COMPETE, EOS: 30.0}, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=12)
    ids = encode_prompt(clients["target"].tokenizer, PROMPTS[0])
    ref = _generate(clients["target"], ids, **kw).token_ids
    assert len(ref) == 13 and ref[-1] == EOS  # EOS masked for 12 tokens, then it wins
    for which in ("agree", "disagree"):
        chunks = clients[which].stream_chunks(ids, max_new_tokens=N, **kw)
        streamed = list(next(chunks).token_ids)
        assert 0 < len(streamed) < 12
        [session_id] = list(backend.verifier.sessions._sessions)  # the generation's one session
        assert backend.verifier.close_session(session_id)
        streamed += [t for chunk in chunks for t in chunk.token_ids]
        res = clients[which].last_result
        assert res.num_reopened_sessions == 1, which
        assert res.token_ids == ref, which


def test_num_output_tokens_out_of_range_is_refused(tiny_pair, backend):
    """In-process and over gRPC (INVALID_ARGUMENT naming the field): not below the prompt's length, negative, or
    not below max_new_tokens; nothing opened."""
    from specdec_runtime.common.errors import InvalidRequestError
    from specdec_runtime.common.types import StoppingCriteria
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
    from specdec.embedded import EmbeddedServer

    bad = ((3, StoppingCriteria(8)), (-1, StoppingCriteria(8)), (2, StoppingCriteria(2)))
    for n, stopping in bad:
        with pytest.raises(InvalidRequestError, match="num_output_tokens"):
            backend.open_session(OpenRequest([5, 6, 7], SamplingParams(), stopping, num_output_tokens=n))
    assert backend.verifier.sessions.num_sessions == 0  # nothing opened
    with EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir)), grace_s=1.0) as address:
        remote = GrpcBackend(address)
        try:
            with pytest.raises(InvalidRequestError, match="num_output_tokens"):
                remote.open_session(OpenRequest([5, 6, 7], SamplingParams(), StoppingCriteria(8), num_output_tokens=3))
            opened = remote.open_session(OpenRequest([5, 6, 7], SamplingParams(), StoppingCriteria(8),
                                                     num_output_tokens=2))
            assert opened.committed_length == 3
        finally:
            remote.close()
