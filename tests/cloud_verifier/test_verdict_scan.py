"""The CPU scans of the batched verdict (cloud_verifier.verdict.scan_numpy, and scan_native, the same
computation compiled) at a real vocabulary size: their contract checked against exact float64 arithmetic over
whole rows (normaliser bounds, candidates, the bound on every token left out), their fast top-p decisions against
the reference's full sort, and the rows they must leave to the exact paths (a normaliser the bounds leave open, a
nucleus wider than the candidates, ties at the top); the compiled scan field for field against the numpy one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from specdec_runtime.cloud_verifier.verdict.numerics import verify_row
from specdec_runtime.cloud_verifier.verdict.sampler import BatchedRejectionSampler, VerifyRow
from specdec_runtime.cloud_verifier.verdict.scan import Scan, scan_logits
from specdec_runtime.cloud_verifier.verdict.scan_native import available as native_available, scan_native
from specdec_runtime.cloud_verifier.verdict.scan_numpy import BOUND_GAP, EXACT_GAP
from specdec_runtime.cloud_verifier.verdict.warpers import sparse_probs
from specdec_runtime.common.types import DraftBlock, SamplingParams

V = 32768  # a real vocabulary's scale: the scan's bounds and gathers only matter at this size
C = 64


def _lm_rows(rng: np.random.Generator, n: int) -> np.ndarray:  # [n, V] float32, an LM's spread
    x = rng.standard_normal((n, V)) * rng.uniform(1.5, 3.5, (n, 1))
    for i in range(n):
        peaks = rng.choice(V, int(rng.integers(1, 60)), replace=False)
        x[i, peaks] += rng.uniform(4.0, 16.0, len(peaks))
    return x.astype(np.float32)


def _special_rows() -> np.ndarray:  # [6, V] float32: the cases the scan must not get wrong
    rows = np.zeros((6, V), dtype=np.float32)  # row 0: all tied (the top bucket alone holds > C tokens)
    rows[1, :] = -40.0  # row 1: one peak, nothing else within EXACT_GAP (fewer than C gathered: padding)
    rows[1, 123] = 0.0
    rows[2, :] = -17.5  # row 2 at T 1: every other token between the two gaps (the band's bound is what counts)
    rows[2, 7] = 0.0
    rows[3, :] = -18.0 + np.arange(V, dtype=np.float32) * 1e-4  # row 3: a dense band just below the threshold
    rows[3, 5] = 0.0
    rows[4, :100] = 3.0  # row 4: 100 tokens tied at the top, the rest far below
    rows[4, 100:] = -30.0
    rows[5, :] = -40.0  # row 5 at T 1: tokens exactly at both thresholds (max - 16 and max - 20), in every tail
    rows[5, 0] = 0.0
    rows[5, 1::7] = -EXACT_GAP
    rows[5, 3::11] = -BOUND_GAP
    return rows


CPU_BACKENDS = ["numpy", pytest.param("native", marks=pytest.mark.skipif(
    not native_available(), reason="no C compiler: the compiled scan is unavailable"))]


def _scan(rows: list[np.ndarray], temperature: float, valid: int = V, threads: int = 1, backend: str = "numpy",
          sampled: np.ndarray | None = None) -> Scan:
    tensors = [torch.from_numpy(r) for r in rows]
    n = sum(len(r) for r in rows)
    sampled = np.ones(n, dtype=bool) if sampled is None else sampled
    return scan_logits(tensors, valid, sampled, np.full(n, temperature), C, backend, threads)


def _check_contract(x: np.ndarray, scan: Scan, temperature: float) -> None:
    """x [n, vocab] the rows' valid logits; every field of the scan against exact arithmetic over them."""
    cand, ids = scan.cand_logits.numpy(), scan.cand_ids.numpy()
    for i, row in enumerate(x):
        m = row.max()
        assert scan.max_logit[i] == m
        z = np.exp(row.astype(np.float64) / temperature - np.float64(m) / temperature).sum()
        assert scan.z_low[i] <= z * (1 + 1e-12) and z <= scan.z_high[i] * (1 + 1e-12)
        real = ids[i] >= 0
        assert real.sum() >= 1 and len(set(ids[i][real])) == real.sum()
        assert np.array_equal(cand[i][real], row[ids[i][real]])
        assert np.all(np.diff(cand[i][real]) <= 0) and np.all(np.isneginf(cand[i][~real]))
        assert cand[i][0] == m
        left_out = np.delete(row, ids[i][real])
        if len(left_out):
            assert left_out.max() <= scan.outside_logit[i] <= cand[i][real].min()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.6])
def test_cpu_scan_contract_on_lm_like_and_special_rows(temperature, backend):
    """Normaliser bounds, candidates and the bound on the tokens left out hold exactly on 60 LM-like positions
    and the special rows; the bounds are tight (within 1e-3 of the normaliser) on the LM-like ones."""
    rng = np.random.default_rng(int(temperature * 10))
    rows = [_lm_rows(rng, 4) for _ in range(15)] + [_special_rows()]
    scan = _scan(rows, temperature, backend=backend)
    x = np.concatenate(rows)
    _check_contract(x, scan, temperature)
    width = ((scan.z_high - scan.z_low) / scan.z_low).numpy()[:60]
    assert np.median(width) < 1e-3, np.median(width)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_scan_on_a_view_of_the_valid_vocabulary_and_on_two_threads(backend):
    """Columns past valid_vocab_size (a non-contiguous view) are never read as tokens; two threads give the
    same fields as one."""
    rng = np.random.default_rng(1)
    rows = [_lm_rows(rng, 3) for _ in range(12)]
    valid = V - 5
    for r in rows:
        r[:, valid:] = 100.0  # padding columns: far above every token, must be ignored
    one = _scan(rows, 0.7, valid, backend=backend)
    _check_contract(np.concatenate(rows)[:, :valid], one, 0.7)
    two = _scan(rows, 0.7, valid, threads=2, backend=backend)
    for a, b in zip(vars(one).values(), vars(two).values()):
        assert torch.equal(a, b)


def _avx512() -> bool:
    try:
        return " avx512f" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def _library_built_with(flags: list[str] | None, tmp_path):  # None: this machine's default build
    if flags is None:
        return None
    if not native_available():
        pytest.skip("no C compiler: the compiled scan is unavailable")
    if "-march=native" in flags and not _avx512():
        pytest.skip("this CPU has no AVX-512: the default build is the AVX2 one")
    import shutil

    from specdec_runtime.cloud_verifier.verdict.scan_native import compile_to, load

    path = tmp_path / "scan.so"
    compile_to(path, shutil.which("cc") or shutil.which("gcc"), flags)
    return load(path)


# each code path of verdict/scan_native.c: AVX-512, AVX2 (a CPU without AVX-512), plain C (neither)
BUILDS = [None, ["-O3", "-march=native"], ["-O3", "-mavx2", "-mfma", "-mno-avx512f"], ["-O3", "-mno-avx", "-mno-avx2"]]


@pytest.mark.skipif(not native_available(), reason="no C compiler: the compiled scan is unavailable")
@pytest.mark.parametrize("flags", BUILDS, ids=["default", "avx512", "avx2", "plain"])
@pytest.mark.parametrize("temperature", [0.3, 1.0])
def test_native_scan_gives_the_numpy_scans_fields(temperature, flags, tmp_path):
    """The compiled scan computes what the numpy one does, field for field: max, argmax and candidates equal
    (candidates as sets: the order among tied logits is free), normaliser bounds within 1e-13 (exp of two
    libraries), on LM-like rows, the special rows, faulty ones (NaN, +inf, all -inf) and greedy positions mixed
    in, from rows of 1 to 5 positions and a non-contiguous column."""
    rng = np.random.default_rng(int(temperature * 10) + 50)
    faulty = _lm_rows(rng, 3)
    faulty[0, 77], faulty[1, 5], faulty[2, :] = np.nan, np.inf, -np.inf
    rows = [_lm_rows(rng, int(rng.integers(1, 6))) for _ in range(12)] + [_special_rows(), faulty, faulty.copy()]
    rows.append(np.asfortranarray(_lm_rows(rng, 2)))  # each token's logits strided
    n = sum(len(r) for r in rows)
    sampled = rng.random(n) < 0.8
    sampled[n - 8:n - 5], sampled[n - 5:n - 2] = True, False  # the faulty positions sampled, then greedy
    valid = V - 3  # not a multiple of the vector widths: the scalar tails run too
    a = _scan(rows, temperature, valid, sampled=sampled, backend="numpy")
    lib = _library_built_with(flags, tmp_path)
    tensors = [torch.from_numpy(r) for r in rows]
    b = Scan(*[torch.from_numpy(np.ascontiguousarray(f)) for f in scan_native(
        tensors, valid, sampled, np.full(n, temperature), C, 1, lib=lib)])
    assert torch.equal(a.max_logit.isnan(), b.max_logit.isnan())
    ok = ~a.max_logit.isnan()
    assert torch.equal(a.max_logit[ok], b.max_logit[ok]) and torch.equal(a.argmax[ok], b.argmax[ok])
    fine = torch.isfinite(a.max_logit[torch.from_numpy(sampled)])  # faulty positions: the guard refuses them
    for i in torch.nonzero(fine)[:, 0].tolist():
        assert set(a.cand_ids[i].tolist()) == set(b.cand_ids[i].tolist()), i
        assert torch.equal(a.cand_logits[i].sort().values, b.cand_logits[i].sort().values)
        assert a.outside_logit[i] == b.outside_logit[i]
        for za, zb in ((a.z_low[i], b.z_low[i]), (a.z_high[i], b.z_high[i])):
            assert abs(za - zb) <= 1e-13 * za, (i, za, zb)


def _row(logits: np.ndarray, sampling: SamplingParams, seed: int, draft: list[int]) -> VerifyRow:
    return VerifyRow(DraftBlock(draft, None), logits, sampling.seeded(seed), 100)


def test_fast_decisions_and_their_fallbacks_give_the_reference_tokens():
    """Rows built to take each path: a normaliser the bounds leave open at the top-p boundary (decided by the
    exact normaliser), a nucleus wider than the candidates (the dense path), ties at the top, and ordinary
    LM-like rows (the fast path); every verdict is the reference's, and each path is shown to be taken."""
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    # open: the second token is kept iff z > 1 / 0.9 (then p(top) < 0.9); the true z is 5e-4 above it, and
    # the band's bound leaves z_high - z_low ~ 4e-3 around it
    open_row = np.full(V, -17.0, dtype=np.float32)  # V - 2 tokens within the band: z_high - z_low ~ 1e-3
    open_row[0] = 0.0
    open_row[1] = np.float32(np.log(1 / 0.9 + 5e-4 - 1 - (V - 2) * np.exp(-17.0)))  # z = 1/0.9 + 5e-4
    wide = np.zeros(V, dtype=np.float32)  # a flat row: the nucleus holds 90% of 32,768 tokens
    wide[:10] = 1.0
    ties = np.full(V, -30.0, dtype=np.float32)
    ties[:100] = 3.0
    rng = np.random.default_rng(3)
    ordinary = _lm_rows(rng, 40)
    special = [open_row, wide, ties]
    rows = [_row(np.stack([r, r]), sampling, s, [int(np.argmax(r))]) for s, r in enumerate(special)]
    rows += [_row(ordinary[i:i + 2], sampling, 10 + i, [int(np.argmax(ordinary[i]))]) for i in range(0, 40, 2)]
    scan = _scan([r.logits for r in rows], 1.0)
    n = len(scan.max_logit)
    f64 = dict(dtype=torch.float64)
    _, _, decided, z_open = sparse_probs(scan, V, torch.full((n,), 1.0, **f64), torch.zeros(n, dtype=torch.int64),
                                         torch.full((n,), 0.9, **f64), torch.zeros(n, **f64))
    assert z_open[0] and not decided[0]  # the open row: the bounds cannot decide it
    assert not decided[2] and not z_open[2]  # the wide nucleus: dense
    assert decided[6:].float().mean() > 0.7  # the ordinary rows: most decided by the fast path (85% here)
    got = BatchedRejectionSampler()(rows, V)
    want = [verify_row(r.block, r.logits, r.sampling, r.start_position, V) for r in rows]
    assert got == want


@pytest.mark.parametrize("env", [{"SPECDEC_NATIVE_SCAN": "0"}, {"CC": "/nonexistent/cc"}])
def test_without_the_compiled_scan_the_numpy_one_runs(env, tmp_path):
    """Switched off, or with no working compiler (and nothing compiled in this cache): the compiled scan is
    unavailable and the batched verdict runs on the numpy scan, same tokens as the reference."""
    code = (
        "import numpy as np\n"
        "from specdec_runtime.cloud_verifier.verdict.scan_native import available\n"
        "from specdec_runtime.cloud_verifier.verdict.sampler import BatchedRejectionSampler, VerifyRow\n"
        "from specdec_runtime.cloud_verifier.verdict.numerics import verify_row\n"
        "from specdec_runtime.common.types import DraftBlock, SamplingParams\n"
        "assert not available()\n"
        "rng = np.random.default_rng(0)\n"
        "x = (rng.standard_normal((3, 4096)) * 2).astype(np.float32)\n"
        "row = VerifyRow(DraftBlock([int(x[0].argmax()), 5], None), x,"
        " SamplingParams(temperature=0.7, top_p=0.9, seed=3), 10)\n"
        "got = BatchedRejectionSampler()([row], 4096)\n"
        "assert got == [verify_row(row.block, x, row.sampling, 10, 4096)], got\n"
        "print('numpy scan ok')\n")
    run_env = {**os.environ, "SPECDEC_CACHE_DIR": str(tmp_path), "TMPDIR": str(tmp_path), **env}
    out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "numpy scan ok" in out.stdout, out.stderr[-2000:]
