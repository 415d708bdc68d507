"""Device and dtype of the target: settings ``device`` / ``dtype`` (``auto`` included) resolve to torch objects;
a CUDA device where CUDA is not available is a clear error at startup, not a silent fallback to the CPU."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from specdec_runtime.cloud_verifier.config import VerifierSettings
from specdec_runtime.cloud_verifier.target.runner import TargetRunner, resolve_device, resolve_dtype
from specdec_runtime.cloud_verifier.verifier import Verifier


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine as one without CUDA (also on a GPU machine)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_settings_default_to_auto_and_read_the_environment(monkeypatch):
    settings = VerifierSettings(metrics_port=0)
    assert (settings.device, settings.dtype) == ("auto", "auto")
    monkeypatch.setenv("SPECDEC_DEVICE", "cuda:1")
    monkeypatch.setenv("SPECDEC_DTYPE", "float16")
    settings = VerifierSettings(metrics_port=0)
    assert (settings.device, settings.dtype) == ("cuda:1", "float16")


@pytest.mark.parametrize("field, value", [("device", "gpu"), ("device", "cuda:"), ("device", "mps"),
                                          ("dtype", "int8"), ("dtype", "fp32")])
def test_settings_refuse_unknown_names(field, value):
    with pytest.raises(ValidationError, match=field):
        VerifierSettings(metrics_port=0, **{field: value})


def test_auto_is_cpu_without_cuda(no_cuda):
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32


def test_auto_is_cuda_bfloat16_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device = resolve_device("auto")
    assert device.type == "cuda"
    assert resolve_dtype("auto", device) is torch.bfloat16


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "CUDA"])
def test_cuda_without_cuda_is_an_error(no_cuda, name):
    with pytest.raises(ValueError, match="CUDA is not available") as e:
        resolve_device(name)
    assert "\n" not in str(e.value)


def test_cuda_index_past_the_devices_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="only 1 CUDA device"):
        resolve_device("cuda:1")


def test_unknown_device_or_dtype_is_an_error():
    for bad in ("gpu", "mps", "cuda:x"):
        with pytest.raises(ValueError, match="unknown device"):
            resolve_device(bad)
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", torch.device("cpu"))


def test_dtype_names():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype("float16", cpu) is torch.float16
    assert resolve_dtype(torch.float16, cpu) is torch.float16  # a torch dtype passes through


def test_from_settings_auto_loads_the_target_on_cpu_in_float32(tiny_pair, no_cuda):
    settings = VerifierSettings(target=str(tiny_pair.target_dir), metrics_port=0, kv_cache_budget_tokens=1024)
    verifier = Verifier.from_settings(settings)
    try:
        runner = verifier.target
        assert runner.device == torch.device("cpu") and runner.dtype is torch.float32
        assert next(runner.model.parameters()).dtype is torch.float32
        assert runner.kv_bytes_per_token == runner.num_layers * 2 * runner.num_kv_heads * runner.head_dim * 4
    finally:
        verifier.shutdown()


def test_from_settings_dtype_loads_the_model_in_it(tiny_pair, no_cuda):
    settings = VerifierSettings(target=str(tiny_pair.target_dir), metrics_port=0, device="cpu", dtype="bfloat16",
                                kv_cache_budget_tokens=1024)
    verifier = Verifier.from_settings(settings)
    try:
        runner = verifier.target
        assert runner.dtype is torch.bfloat16 and next(runner.model.parameters()).dtype is torch.bfloat16
        kv = runner.allocate(8)
        assert runner.kv_pool.tensor.dtype is torch.bfloat16
        runner.free(kv)
    finally:
        verifier.shutdown()


def test_from_settings_cuda_without_cuda_fails_at_startup(tiny_pair, no_cuda):
    settings = VerifierSettings(target=str(tiny_pair.target_dir), metrics_port=0, device="cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        Verifier.from_settings(settings)
    with pytest.raises(ValueError, match="CUDA is not available"):
        TargetRunner(tiny_pair.target_dir, device="cuda")  # no silent fallback to the CPU
