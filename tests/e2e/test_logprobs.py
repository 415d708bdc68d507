"""Logprobs under speculation: the log-probability of each committed token and its top-5 alternatives (raw
log-softmax of the target) equal target-only decoding's within 1e-4 with the same top-5 ids (greedy: the same
tokens), and a teacher-forced HF forward pass over the output's tokens (greedy and sampled); they travel through
the real gRPC server and come back only when asked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _hf_processors import _model
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer, LocalBackend

N = 16
TOP = 5


@pytest.fixture(scope="module")
def backend(tiny_pair):
    b = LocalBackend(Verifier(TargetRunner(tiny_pair.target_dir), max_num_speculative_tokens=8))
    yield b
    b.close()


def _clients(tiny_pair, backend):
    model = OnnxDraftModel(tiny_pair.other_draft_dir)  # a draft that disagrees often: rejections, recovered tokens
    spec = EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=4)
    return spec, EdgeClient(backend, None, model.tokenizer)


def _hf_logprobs(model_dir, prompt_ids, output_ids) -> np.ndarray:  # [len(output_ids), vocab_size]
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.inference_mode():
        logits = _model(str(model_dir))(ids).logits[0, len(prompt_ids) - 1: -1].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def _check_against(result, ref: np.ndarray):
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for j, (t, lp) in enumerate(zip(result.token_ids, result.logprobs)):
        assert abs(lp.logprob - ref[j, t]) < 1e-4
        want = np.argsort(-ref[j], kind="stable")[:TOP]
        assert list(lp.top_token_ids) == want.tolist()
        np.testing.assert_allclose(lp.top_logprobs, ref[j, want], atol=1e-4)


def test_greedy_logprobs_equal_target_only_and_hf(tiny_pair, backend):
    spec, target = _clients(tiny_pair, backend)
    ids = encode_prompt(target.tokenizer, "Why is the sky blue?")
    a = spec.generate(ids, max_new_tokens=N, ignore_eos=True, logprobs=True, top_logprobs=TOP)
    b = target.generate(ids, max_new_tokens=N, ignore_eos=True, logprobs=True, top_logprobs=TOP)
    assert a.token_ids == b.token_ids and a.stats.num_accepted_tokens < a.stats.num_draft_tokens  # rejections
    for x, y in zip(a.logprobs, b.logprobs):
        assert abs(x.logprob - y.logprob) < 1e-4 and x.top_token_ids == y.top_token_ids
    _check_against(a, _hf_logprobs(tiny_pair.target_dir, ids, a.token_ids))
    assert "logprobs" in a.to_json() and len(a.to_json()["logprobs"][0]["top_logprobs"]) == TOP
    plain = spec.generate(ids, max_new_tokens=N, ignore_eos=True)
    assert plain.logprobs is None and "logprobs" not in plain.to_json()  # only when asked


def test_sampled_logprobs_with_penalties_are_the_raw_target_ones(tiny_pair, backend):
    """Sampled, with penalties and a bias: the reported numbers are the raw log-softmax (before processing)."""
    spec, _ = _clients(tiny_pair, backend)
    ids = encode_prompt(spec.tokenizer, "List three prime numbers.")
    res = spec.generate(ids, max_new_tokens=N, ignore_eos=True, temperature=1.0, seed=3, logprobs=True,
                        top_logprobs=TOP, presence_penalty=0.5, logit_bias={100: 3.0})
    _check_against(res, _hf_logprobs(tiny_pair.target_dir, ids, res.token_ids))


def test_logprobs_over_grpc(tiny_pair):
    verifier = Verifier(TargetRunner(tiny_pair.target_dir), max_num_speculative_tokens=8)
    with EmbeddedServer(verifier=verifier) as address:
        model = OnnxDraftModel(tiny_pair.draft_dir)
        with EdgeClient.connect(address, tiny_pair.draft_dir, num_speculative_tokens=4) as client:
            ids = encode_prompt(model.tokenizer, "Why is the sky blue?")
            res = client.generate(ids, max_new_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)
    ref = _hf_logprobs(tiny_pair.target_dir, ids, res.token_ids)
    assert len(res.logprobs) == 8
    for j, (t, lp) in enumerate(zip(res.token_ids, res.logprobs)):
        assert abs(lp.logprob - ref[j, t]) < 1e-4 and len(lp.top_token_ids) == 2


def test_streamed_chunks_carry_their_tokens_logprobs(tiny_pair, backend):
    """The SDK stream hands each committed token's logprobs with the chunk that carries the token: more than one
    chunk has some, and together they are the result's, token for token."""
    spec, _ = _clients(tiny_pair, backend)
    ids = encode_prompt(spec.tokenizer, "Why is the sky blue?")
    chunks = list(spec.stream_chunks(ids, max_new_tokens=N, ignore_eos=True, logprobs=True, top_logprobs=TOP))
    res = spec.last_result
    assert sum(1 for c in chunks if c.logprobs) > 1
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == res.token_ids
    assert [lp for c in chunks for lp in c.logprobs] == res.logprobs
    plain = list(spec.stream_chunks(ids, max_new_tokens=N, ignore_eos=True))
    assert all(c.logprobs == () for c in plain) and [t for c in plain for t in c.token_ids] == res.token_ids
