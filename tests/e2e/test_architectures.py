"""The architecture matrix: every causal-LM family the verifier and the draft exporter claim, as a tiny random
model (tests/_architectures.py), end to end. Per architecture:

- the verifier's ragged forward equals the HF reference (a prefill chunk and a decode block of two sessions in
  one batch, a rejected block rolled back, sequences longer than the sliding windows);
- greedy speculative decoding (the model's own ONNX export as the draft) is token-identical to target-only
  decoding and to HF ``generate``;
- the draft exports to ONNX (the GenAI builder where it handles the architecture, torch.onnx otherwise) and the
  draft runner's logits (KV cache kept across calls, rolled back) match PyTorch.

Hybrid families (conv / SSM / linear-attention layers beside attention, tests/_architectures.py ``HYBRIDS``): the
ragged forward equals the HF reference; greedy speculative decoding with a tiny Llama draft on the same tokenizer
(sharing the target's embeddings: drafts are rejected often; exported by torch.onnx) is token-identical to
target-only decoding and to HF ``generate``; exporting a hybrid as the draft is refused in one line.

Architectures the verifier cannot run are refused at load time with one line naming what is missing. Each model
is built and exported once per test session (tests/e2e/conftest.py ``arch_models``, shared with other modules).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from _architectures import ARCHITECTURES, HYBRIDS, REFUSED
from _reference import hf_greedy
from specdec_runtime.cloud_verifier.target.architectures import UnsupportedArchitectureError
from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow
from specdec_runtime.cloud_verifier.kv.recurrent_state import SessionState
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.paths import EXPORT_REPORT
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import LocalBackend
from specdec.models import FP32_TOLERANCE, export_onnx_draft

pytestmark = pytest.mark.slow

# The graph builder each architecture's draft gets with builder="auto" (GenAI where its builder handles it).
EXPECTED_BUILDER = {arch: "genai" for arch in ARCHITECTURES}
EXPECTED_BUILDER["gemma3"] = "torch"  # GenAI 0.18's builder reads a flat rope_parameters (KeyError 'rope_type')
PROMPT = [1, 504, 3458, 314, 253, 1789, 30, 357, 4564, 2517, 28, 2145, 2016, 260]  # 14 ids, BOS first
NEW_TOKENS = 40  # prompt + output = 54 positions: past the 16-token windows


@pytest.fixture(scope="module")
def runners(arch_models):
    cache: dict[str, TargetRunner] = {}

    def get(arch: str) -> TargetRunner:
        if arch not in cache:
            cache[arch] = TargetRunner(arch_models(arch, export=False)[0], kv_cache_budget_tokens=4096)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHITECTURES + HYBRIDS)
def test_ragged_forward_matches_hf_reference(runners, arch):
    runner = runners(arch)
    rng = np.random.default_rng(1)
    a = rng.integers(3, 40000, 60).tolist()
    b = rng.integers(3, 40000, 45).tolist()
    ref_a, ref_b = runner.reference_logits(a), runner.reference_logits(b)
    kv_a, kv_b = runner.allocate(64), runner.allocate(64)
    try:
        # session a prefills 40 tokens (the SDPA path) while session b prefills 20 (the small path)
        out = runner.forward([ForwardRow(kv_a, a[:40], 0), ForwardRow(kv_b, b[:20], 0)])
        got_a, got_b = [out[0]], [out[1]]
        # a draft block of b rejected after 2 tokens: its last 3 positions are overwritten by the next rows
        out = runner.forward([ForwardRow(kv_b, b[20:22] + [7, 8, 9], 20), ForwardRow(kv_a, a[40:44], 40)])
        got_b.append(out[0][:2])
        got_a.append(out[1])
        out = runner.forward([ForwardRow(kv_a, a[44:], 44), ForwardRow(kv_b, b[22:], 22)])
        got_a.append(out[0])
        got_b.append(out[1])
    finally:
        runner.free(kv_a)
        runner.free(kv_b)
    for got, ref in ((got_a, ref_a), (got_b, ref_b)):
        got = np.concatenate(got)
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_speculative_identical_to_target_only_and_hf(arch_models, runners, arch):
    hf_dir, onnx_dir = arch_models(arch)
    backend = LocalBackend(Verifier(runners(arch), max_num_speculative_tokens=8))
    try:
        model = OnnxDraftModel(onnx_dir)
        spec = EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=4)
        res = spec.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        plain = EdgeClient(backend, None, model.tokenizer).generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    finally:
        backend.close()
    assert res.token_ids == plain.token_ids == hf_greedy(hf_dir, PROMPT, NEW_TOKENS)
    assert res.stats.acceptance_rate > 0.8  # the draft is the target itself, in ONNX


@pytest.mark.parametrize("arch", HYBRIDS)
def test_hybrid_greedy_speculative_identical_to_target_only_and_hf(arch_models, runners, arch):
    hf_dir, onnx_dir = arch_models(arch)
    backend = LocalBackend(Verifier(runners(arch), max_num_speculative_tokens=8))
    try:
        model = OnnxDraftModel(onnx_dir)
        spec = EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=4)
        res = spec.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        plain = EdgeClient(backend, None, model.tokenizer).generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    finally:
        backend.close()
    assert res.token_ids == plain.token_ids == hf_greedy(hf_dir, PROMPT, NEW_TOKENS)
    stats = res.stats
    # drafts rejected often, accepted sometimes: rolled-back blocks and accepted blocks both reach the state
    assert stats.num_draft_tokens - stats.num_accepted_tokens >= 10 and stats.num_accepted_tokens >= 5, stats


@pytest.mark.parametrize("arch", HYBRIDS)
def test_hybrid_negative_control_cropping_instead_of_restoring_state_differs(arch_models, runners, arch,
                                                                             monkeypatch):
    """What an engine that only crops the KV cache does: after a half-rejected block the recurrent state stays
    the one after the whole block. The output must then differ from target-only decoding (the test above bites)."""
    advance = SessionState.advance

    def crop(state, layer, start, mixer):
        if state.position < start < state.position + state.length:
            state.committed[layer] = state.end[layer]
            return state.end[layer].fork()
        return advance(state, layer, start, mixer)

    hf_dir, onnx_dir = arch_models(arch)
    backend = LocalBackend(Verifier(runners(arch), max_num_speculative_tokens=8))
    monkeypatch.setattr(SessionState, "advance", crop)
    try:
        model = OnnxDraftModel(onnx_dir)
        spec = EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=4)
        res = spec.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    finally:
        backend.close()
    assert res.token_ids != hf_greedy(hf_dir, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_hybrid_draft_export_refused_in_one_line(arch_models, tmp_path, arch):
    hf_dir, _ = arch_models(arch, export=False)
    with pytest.raises(ValueError) as info:
        export_onnx_draft(hf_dir, tmp_path / "draft", quantize_int8=False, progress=False)
    message = str(info.value)
    assert "recurrent state the ONNX draft cannot carry" in message and "\n" not in message


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_draft_export_matches_pytorch(arch_models, arch):
    from transformers import AutoModelForCausalLM

    hf_dir, onnx_dir = arch_models(arch)
    report = json.loads((onnx_dir / EXPORT_REPORT).read_text())
    assert report["builder"] == EXPECTED_BUILDER[arch], report.get("genai_builder_error") or report.get(
        "genai_check_error")
    assert report["fp32_check"]["max_abs_diff"] <= FP32_TOLERANCE
    ids = np.random.default_rng(2).integers(3, 40000, 50).tolist()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    draft = OnnxDraftModel(onnx_dir)
    got = [draft.forward(ids[:30])]
    got += [draft.forward([t]) for t in ids[30:35]]
    draft.rollback(33)  # two rejected tokens
    got = np.concatenate([np.concatenate(got)[:33], draft.forward(ids[33:])])
    assert np.abs(got - ref).max() <= FP32_TOLERANCE


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_unsupported_architecture_refused_in_one_line(arch_models, arch):
    hf_dir, _ = arch_models(arch, export=False)
    with pytest.raises(UnsupportedArchitectureError) as info:
        TargetRunner(hf_dir)
    message = str(info.value)
    assert REFUSED[arch] in message and "\n" not in message
    assert isinstance(info.value, ValueError)  # `specdec serve` prints ValueErrors as one `error:` line
