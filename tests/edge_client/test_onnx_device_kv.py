"""The ONNX draft's shared KV buffers in ORT-allocated memory (the CUDA provider's mode: the cache stays on the
device), exercised here on the CPU: the same logits, bit for bit, as the numpy buffers of the CPU provider and
as per-step present arrays, through prefill, steps, rollback and buffer growth; a provider that cannot run them
falls back to host arrays with a warning."""

from __future__ import annotations

import logging

import numpy as np

from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel


def _on_ort_memory(model: OnnxDraftModel, device: str = "cpu") -> OnnxDraftModel:
    """Make ``model`` keep its shared KV buffers as ORT-allocated OrtValues on ``device`` (as on CUDA)."""
    model._kv_device = device
    model._buffers, model._binding = [], None
    model.reset()
    return model


def _script(model: OnnxDraftModel) -> list[np.ndarray]:
    """Prefill, steps, rollback, growth past the first 256-position buffers, rollback again."""
    rng = np.random.default_rng(0)
    out = [model.forward(rng.integers(3, 5000, size=40).tolist())]
    for t in (17, 99, 1234, 7):
        out.append(model.forward([t]))
    model.rollback(30)
    out.append(model.forward([5, 6, 7]))
    out.append(model.forward(rng.integers(3, 5000, size=250).tolist()))  # 283 positions: the buffers grow
    model.rollback(100)
    out.append(model.forward([8, 9]))
    return out


def test_kv_buffers_in_ort_memory_give_identical_logits(tiny_pair):
    numpy_kv = OnnxDraftModel(tiny_pair.draft_dir)
    assert numpy_kv.share_kv_buffer and numpy_kv._kv_device is None  # the CPU provider's default
    ort_kv = _on_ort_memory(OnnxDraftModel(tiny_pair.draft_dir))
    present = OnnxDraftModel(tiny_pair.draft_dir, share_kv_buffer=False)
    a, b, c = _script(numpy_kv), _script(ort_kv), _script(present)
    assert not isinstance(ort_kv._buffers[0], np.ndarray)  # OrtValues, grown past 256 positions
    assert tuple(ort_kv._buffers[0].shape())[2] > 256 and ort_kv.share_kv_buffer
    for i, (x, y, z) in enumerate(zip(a, b, c)):
        assert np.array_equal(x, y), f"step {i}: ORT-memory buffers differ from numpy buffers"
        assert np.array_equal(x, z), f"step {i}: shared buffers differ from present arrays"


def test_kv_buffers_a_provider_cannot_run_fall_back_to_host_arrays(tiny_pair, caplog):
    model = _on_ort_memory(OnnxDraftModel(tiny_pair.draft_dir), device="no-such-device")
    reference = OnnxDraftModel(tiny_pair.draft_dir, share_kv_buffer=False)
    with caplog.at_level(logging.WARNING, logger="specdec_runtime.edge_client.drafting.onnx_draft"):
        got = _script(model)
    assert not model.share_kv_buffer
    assert any("falling back to host KV arrays" in r.message for r in caplog.records)
    for x, y in zip(got, _script(reference)):
        assert np.array_equal(x, y)
