"""The compiled verdict scan on a machine without a C compiler (a container image): the variants
cloud_verifier.verdict.scan_native.prebuild compiles at build time are found through SPECDEC_NATIVE_SCAN_DIR,
the widest the CPU runs is loaded, and it scans as the numpy backend does; a library built from another source is
never loaded."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from specdec_runtime.cloud_verifier.verdict import scan_native
from specdec_runtime.cloud_verifier.verdict.scan_numpy import scan_numpy

V = 4096


@pytest.fixture
def prebuilt_dir(tmp_path, monkeypatch):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler: nothing to prebuild")
    paths = scan_native.prebuild(tmp_path, compiler)
    assert len(paths) == 3 and all(p.is_file() for p in paths)
    monkeypatch.setenv(scan_native.PREBUILT_DIR_ENV, str(tmp_path))
    return tmp_path


def test_the_widest_variant_this_cpu_runs_is_loaded_and_scans_as_numpy(prebuilt_dir):
    flags = set(scan_native._cpu_flags_line().partition(":")[2].split())
    expected = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "generic"
    lib = scan_native._prebuilt()
    assert lib is not None and lib._name.endswith(f"{expected}-{lib._name.rsplit('-', 1)[1]}")
    rng = np.random.default_rng(0)
    rows = [torch.from_numpy((rng.standard_normal((5, V)) * 3).astype(np.float32))]
    sampled = np.array([True, False, True, True, False])
    temperature = np.full(5, 0.8)
    native = scan_native.scan_native(rows, V, sampled, temperature, 16, lib=lib)
    reference = scan_numpy(rows, V, sampled, temperature, 16)
    for a, b in zip(native, reference, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_no_directory_or_another_sources_library_is_not_loaded(prebuilt_dir, monkeypatch):
    for path in prebuilt_dir.iterdir():  # as built from another version of scan_native.c
        path.rename(path.with_name(path.name.replace("verdict_scan-", "verdict_scan-old-")))
    assert scan_native._prebuilt() is None
    monkeypatch.delenv(scan_native.PREBUILT_DIR_ENV)
    assert scan_native._prebuilt() is None
