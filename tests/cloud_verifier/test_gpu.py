"""Greedy exactness of the GPU path (target on CUDA; the ONNX draft on ONNX Runtime's CUDA provider with its KV
cache in device memory). Skipped without CUDA; scripts/gpu_check.sh runs it on a GPU machine.
SPECDEC_GPU_CHECK_ALLOW_CPU=1 runs it on the CPU instead (a smoke test of the test itself).

- float32: specdec's greedy tokens are exactly the unmodified HF model's argmax at every position (teacher-forced
  along specdec's own output), and equal target-only decoding through the same verifier.
- bfloat16: the batched ragged forward and the reference round differently. Their largest logit difference δ
  along the sequence is measured (and bounded: DELTA_MAX_BF16 of the logit scale); a token may differ from the
  reference's argmax only where its top-2 logits are within 2δ + EPS_BF16 (a near tie: two logits each off by at
  most δ can swap only then); everywhere else it is identical.

SPECDEC_GPU_CHECK_REAL_MODEL=1 adds the prepared SmolLM2-135M pair (scripts/gpu_check.sh prepares it).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import LocalBackend

ALLOW_CPU = os.environ.get("SPECDEC_GPU_CHECK_ALLOW_CPU") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if ALLOW_CPU else None)
pytestmark = [
    pytest.mark.skipif(DEVICE is None, reason="CUDA not available (scripts/gpu_check.sh runs these on a GPU; "
                                              "SPECDEC_GPU_CHECK_ALLOW_CPU=1 runs them on the CPU)"),
    pytest.mark.timeout(300),
]

# bfloat16 keeps 8 mantissa bits (a relative step of 2^-8 = 0.4 %); layers of differently ordered sums add up.
DELTA_MAX_BF16 = 0.05  # largest |ragged - reference| logit difference allowed, relative to the largest |logit|
EPS_BF16 = 1e-3  # margin on top of 2δ, logits
MODELS = ["tiny"] + (["real"] if os.environ.get("SPECDEC_GPU_CHECK_REAL_MODEL") == "1" else [])
PROMPTS = ["Why is the sky blue?", "Write a haiku about autumn leaves.", "List three prime numbers."]
MAX_NEW_TOKENS = 48


def _pair(request, which: str, draft: str):
    """(target dir, draft dir) of the tiny pair (accepting or rejecting draft) or the prepared real pair."""
    if which == "tiny":
        tiny = request.getfixturevalue("tiny_pair")
        return tiny.target_dir, getattr(tiny, draft)
    real = request.getfixturevalue("real_pair")
    return real.target_dir, real.draft_dir


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which, draft", [(m, d) for m in MODELS for d in ("draft_dir", "other_draft_dir")
                                          if m == "tiny" or d == "draft_dir"])  # accepting / rejecting draft
def test_greedy_specdec_is_the_targets_argmax(request, which, draft, dtype):
    target_dir, draft_dir = _pair(request, which, draft)
    runner = TargetRunner(target_dir, device=DEVICE, dtype=dtype)
    assert runner.device.type == DEVICE and str(runner.dtype) == f"torch.{dtype}"
    backend = LocalBackend(Verifier(runner))
    model = OnnxDraftModel(draft_dir)
    tok = model.tokenizer
    spec = EdgeClient(backend, ModelDrafter(model), tok, num_speculative_tokens=4)
    plain = EdgeClient(backend, None, tok)
    near_ties = compared = 0
    try:
        for prompt in PROMPTS:
            ids = encode_prompt(tok, prompt)
            got = spec.generate(ids, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True).token_ids
            target_only = plain.generate(ids, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True).token_ids
            assert len(got) == MAX_NEW_TOKENS
            reference = runner.reference_logits(ids + got)  # unmodified HF model, SDPA, same device and dtype
            ours = _ragged_logits(runner, ids + got)  # the verifier's kernel, teacher-forced on the same tokens
            first = len(ids) - 1
            delta = float(np.abs(ours[first:-1] - reference[first:-1]).max())
            if dtype == "bfloat16":
                assert delta <= DELTA_MAX_BF16 * float(np.abs(reference).max()), f"{prompt!r}: δ = {delta:.3f}"
            for i, token in enumerate(got):
                row = reference[first + i]
                top2 = np.partition(row, -2)[-2:]
                gap = float(top2[1] - top2[0])
                if dtype == "float32" or gap > 2 * delta + EPS_BF16:
                    assert token == int(np.argmax(row)), f"{prompt!r} position {i}: gap {gap:.3f}, δ {delta:.3f}"
                    compared += 1
                else:
                    near_ties += 1
            if dtype == "float32":
                assert got == target_only, f"{prompt!r}: specdec differs from target-only decoding"
    finally:
        backend.close()
    assert compared >= len(PROMPTS) * MAX_NEW_TOKENS // 4, f"{near_ties} near ties: too few positions compared"


def _ragged_logits(runner: TargetRunner, ids: list[int]):
    """Logits of ``ids`` from the verifier's ragged kernel (one row, all positions), float32 numpy."""
    kv = runner.allocate(len(ids))
    try:
        return runner.forward([ForwardRow(kv, ids, 0, "all")])[0]
    finally:
        runner.free(kv)


def test_draft_on_the_device_matches_the_cpu_draft(tiny_pair):
    import onnxruntime as ort

    if DEVICE == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("CUDA not available to ONNX Runtime (install onnxruntime-gpu)")
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if DEVICE == "cuda" else ["CPUExecutionProvider"]
    device_draft = OnnxDraftModel(tiny_pair.draft_dir, providers=providers)
    if DEVICE == "cuda":
        assert device_draft.providers[0] == "CUDAExecutionProvider"
        assert device_draft.share_kv_buffer and device_draft._kv_device == "cuda"  # the cache stays on the GPU
    cpu_draft = OnnxDraftModel(tiny_pair.draft_dir, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    steps = [rng.integers(3, 5000, size=30).tolist()] + [[t] for t in rng.integers(3, 5000, size=20).tolist()]
    for k, ids in enumerate(steps):
        a, b = device_draft.forward(ids), cpu_draft.forward(ids)
        assert np.allclose(a, b, atol=1e-2, rtol=1e-3), f"step {k}: max diff {np.abs(a - b).max()}"
        if k == 10:
            device_draft.rollback(25)
            cpu_draft.rollback(25)
    if DEVICE == "cuda":
        assert device_draft.share_kv_buffer, "the device KV buffers fell back to host arrays"
