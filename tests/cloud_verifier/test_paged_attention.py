"""The paged attention: one attention call per layer for the whole ragged batch, whatever its size, with logits
equal to the per-row reference loop it replaced and to the unmodified HF model — prefill chunks and verify rows
in one batch, several KV page sizes (rows crossing page boundaries), a sliding window shorter than the
contexts (Mistral) and score soft-capping with alternating window/full layers (Gemma 2). On CUDA where there is
one (scripts/gpu_check.sh), else on the CPU: the same code path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _architectures import WINDOW, make_tiny_model
from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow
from specdec_runtime.cloud_verifier.target.runner import TargetRunner

TOL = 1e-4  # relative to the reference's largest logit (float32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    root = tmp_path_factory.mktemp("paged")
    built: dict[str, object] = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = make_tiny_model(arch, root / arch, tokenizer)
        return built[arch]

    return get


def _mixed_batch(runner: TargetRunner, rng: np.random.Generator, num_verify: int):
    """Sessions with histories of different lengths (past the window), prefilled untimed; then ONE batch: a
    40-token prefill chunk of a new session and ``num_verify`` verify rows of 1..6 tokens. Returns the batch's
    rows, each row's full token list (history + row) and the KV caches to free."""
    vocab = 40000
    kvs, rows, fulls = [], [], []
    for i in range(num_verify):
        history = rng.integers(3, vocab, 17 + 9 * (i % 6)).tolist()
        kv = runner.allocate(len(history) + 8)
        runner.forward([ForwardRow(kv, history, 0, "none")])
        new = rng.integers(3, vocab, 1 + i % 6).tolist()
        kvs.append(kv)
        rows.append(ForwardRow(kv, new, len(history), "all"))
        fulls.append(history + new)
    prompt = rng.integers(3, vocab, 40).tolist()
    kv = runner.allocate(48)
    kvs.append(kv)
    rows.append(ForwardRow(kv, prompt, 0, "all"))
    fulls.append(prompt)
    return rows, fulls, kvs


@pytest.mark.parametrize(("arch", "page_size"), [("llama", 16), ("llama", 5), ("mistral", 3), ("gemma2", 7)])
def test_paged_batch_equals_per_row_reference_and_hf(model_dirs, arch, page_size):
    runner = TargetRunner(model_dirs(arch), kv_cache_budget_tokens=1024, kv_page_size=page_size,
                          device=DEVICE)
    rows, fulls, kvs = _mixed_batch(runner, np.random.default_rng(3), num_verify=5)
    try:
        paged = runner.forward(rows)
        with runner.reference_attention():  # the same rows again: the same positions are rewritten
            reference = runner.forward(rows)
    finally:
        for kv in kvs:
            runner.free(kv)
    for row, full, got, ref_row in zip(rows, fulls, paged, reference):
        hf = runner.reference_logits(full)[len(full) - len(row.token_ids):]
        scale = max(1.0, float(np.abs(hf).max()))
        assert np.abs(got - ref_row).max() <= TOL * scale
        assert np.abs(got - hf).max() <= TOL * scale
    assert max(len(f) for f in fulls) > 2 * WINDOW  # the window matters for mistral/gemma2


def _count_attention_calls(runner: TargetRunner, rows, monkeypatch) -> int:
    """Attention kernel calls in one forward pass: SDPA, and ``torch.bmm`` (the reference loop's small path)."""
    import torch.nn.functional as F

    calls = {"n": 0}
    sdpa, bmm = F.scaled_dot_product_attention, torch.bmm

    def counting(fn):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting(sdpa))
    monkeypatch.setattr(torch, "bmm", counting(bmm))
    try:
        runner.forward(rows)
    finally:
        monkeypatch.undo()
    return calls["n"]


@pytest.mark.parametrize("num_verify", [1, 4, 33])
def test_one_attention_call_per_layer_whatever_the_batch_size(model_dirs, monkeypatch, num_verify):
    runner = TargetRunner(model_dirs("llama"), kv_cache_budget_tokens=4096, device=DEVICE,
                          check_architecture=False)
    rows, _, kvs = _mixed_batch(runner, np.random.default_rng(num_verify), num_verify)
    try:
        assert _count_attention_calls(runner, rows, monkeypatch) == runner.num_layers
        # negative control: the per-row reference loop makes one call (SDPA or two bmm) per row and layer,
        # and the counter sees them
        with runner.reference_attention():
            loop_calls = _count_attention_calls(runner, rows, monkeypatch)
        assert loop_calls >= runner.num_layers * len(rows)
    finally:
        for kv in kvs:
            runner.free(kv)


def test_as_tensors_gives_float32_logits_on_the_device(model_dirs):
    runner = TargetRunner(model_dirs("llama"), kv_cache_budget_tokens=256, device=DEVICE,
                          check_architecture=False)
    kv = runner.allocate(16)
    try:
        out = runner.forward([ForwardRow(kv, [5, 6, 7, 8], 0, "all")], as_tensors=True)[0]
        again = runner.forward([ForwardRow(kv, [5, 6, 7, 8], 0, "all")])[0]
    finally:
        runner.free(kv)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.device == runner.device
    assert out.shape == (4, runner.vocab_size)
    np.testing.assert_array_equal(out.cpu().numpy(), again)
