"""Microbenchmark of the verdict stage: the batched verdict (cloud_verifier.verdict.numerics.verify_rows, tensor ops where
the logits are) vs the per-row numpy loop it replaced (cloud_verifier.verdict.numerics.verify_row per row), side by side in
one run, on the same rows.

64 rows × 5 scored positions (γ = 4 draft tokens + the bonus position), the real target's vocabulary (49,152),
sampled at temperature 0.7 / top-p 0.9 with top-k drafting (k = 8; q from the logits plus noise, the draft
token drawn from q), and greedy. Logits are the default target's own when it is prepared (one teacher-forced
forward, ``specdec.logits_bench.real_logits``, rows reused with different draft tokens and seeds), synthetic and
LM-like otherwise. The two paths' verdicts are compared row for row (``agree``).

    python -m specdec.bench.verdict_bench [--rows 64] [--positions 5] [--repeats 20] [--device cpu|cuda]
        [--synthetic]

prints one JSON object: per setting the median ms (wall and process CPU) of each path and their ratio, the batched
path also with its scan on one thread (the default uses torch's intra-op thread count) and, on a CPU, with the
numpy scan instead of the compiled one (``scan_backend``: which one the default used), and where the
sampled positions were decided (``exact_normaliser``: the scan's normaliser bounds left a top-p decision open;
``dense``: the candidates could not decide it; the rest: the fast path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from specdec.bench import _shared  # noqa: F401 - sets OMP_WAIT_POLICY before torch loads

import numpy as np  # noqa: E402
import torch  # noqa: E402

from specdec_runtime.cloud_verifier.verdict import numerics  # noqa: E402
from specdec_runtime.cloud_verifier.verdict.numerics import verify_row, verify_rows  # noqa: E402
from specdec_runtime.cloud_verifier.verdict.sampler import VerifyRow  # noqa: E402
from specdec_runtime.common.draft_topk import draft_topk_distribution  # noqa: E402
from specdec_runtime.common.errors import TargetOutputError  # noqa: E402
from specdec_runtime.common.sampling import Stream, sample_from, uniform  # noqa: E402
from specdec_runtime.common.types import DraftBlock, SamplingParams, SparseDraftProbs  # noqa: E402
from specdec.logits_bench import real_logits, synthetic_logits  # noqa: E402

VOCAB = 49152
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9)
GREEDY = SamplingParams()
_DRAFT = SamplingParams(temperature=0.7)  # the draft's q: top-8 of its tempered logits


def make_rows(logits: np.ndarray, num_rows: int, positions: int, sampling: SamplingParams,
              data_seed: int = 0) -> list[VerifyRow]:
    """``num_rows`` blocks of ``positions - 1`` draft tokens over rows of ``logits`` [n, vocab] (cycled)."""
    rng = np.random.default_rng(data_seed)  # the rows' content; each row's draws: its own session seed
    rows = []
    for r in range(num_rows):
        at = [(r * positions + i) % len(logits) for i in range(positions)]
        block_logits = np.ascontiguousarray(logits[at])  # [positions, vocab]
        ids, q_ids, q_probs = [], [], []
        for i in range(positions - 1):
            noisy = block_logits[i] + rng.normal(0.0, 1.0, block_logits.shape[1]).astype(np.float32)
            t_ids, t_q = draft_topk_distribution(noisy, _DRAFT, 8)  # always 8 ids
            x = int(t_ids[sample_from(t_q.astype(np.float64), uniform(r, 100 + i, Stream.DRAFT_SAMPLE))])
            ids.append(x)
            q_ids.append(t_ids)
            q_probs.append(t_q)
        draft = None if sampling.greedy else SparseDraftProbs(np.stack(q_ids), np.stack(q_probs))
        rows.append(VerifyRow(DraftBlock(ids, draft), block_logits, sampling.seeded(1000 + r), 100))
    return rows


def _numpy_loop(rows: list[VerifyRow], vocab: int) -> list:
    out = []
    for r in rows:
        try:
            out.append(verify_row(r.block, r.logits, r.sampling, r.start_position, vocab))
        except TargetOutputError as e:
            out.append(str(e))
    return out


def _batched(rows: list[VerifyRow], vocab: int, scan_threads: int | None = None, backend: str = "auto") -> list:
    sampler = numerics._SAMPLER
    before = sampler.scan_threads, sampler.scan_backend
    sampler.scan_threads, sampler.scan_backend = scan_threads, backend
    try:
        return [str(v) if isinstance(v, TargetOutputError) else v for v in verify_rows(rows, vocab)]
    finally:
        sampler.scan_threads, sampler.scan_backend = before


def _median_ms(fns: list, repeats: int) -> list[tuple[float, float]]:
    """Per function (median wall ms, median process CPU ms) of ``repeats`` calls after a warm-up, the functions
    interleaved (one call of each per repeat) so that each sees the same load on a shared machine. The CPU time
    is the figure to read on a busy machine: it does not count the time other jobs hold the cores."""
    for fn in fns:
        fn()  # warm-up
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[i].append((time.perf_counter() - t0) * 1e3)
            cpu[i].append((time.process_time() - c0) * 1e3)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, cpu)]


def bench_verdicts(num_rows: int = 64, positions: int = 5, repeats: int = 20, device: str = "cpu",
                   synthetic: bool = False) -> dict:
    """Median ms of the numpy loop and the batched verdict on the same rows, sampled and greedy, their repeats
    interleaved."""
    logits = None if synthetic else real_logits(positions, VOCAB)
    source = "real" if logits is not None else "synthetic"
    if logits is None:
        logits = synthetic_logits(num_rows * positions, VOCAB)
    report: dict = {"bench": "verdict", "rows": num_rows, "positions": positions, "vocab_size": VOCAB,
                    "logits": source, "device": device, "torch_threads": torch.get_num_threads(),
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "repeats": repeats}
    for name, sampling in (("sampled_t0.7_top_p0.9", SAMPLED), ("greedy", GREEDY)):
        rows = make_rows(logits, num_rows, positions, sampling)
        on_device = [VerifyRow(r.block, torch.from_numpy(r.logits).to(device), r.sampling, r.start_position)
                     for r in rows]
        if device != "cpu":
            torch.cuda.synchronize()
        fns = [lambda: _numpy_loop(rows, VOCAB), lambda: _batched(on_device, VOCAB),
               lambda: _batched(on_device, VOCAB, scan_threads=1)]
        if device == "cpu":  # the numpy scan beside the compiled one (where the compiled one is the default)
            fns.append(lambda: _batched(on_device, VOCAB, backend="numpy"))
        timed = _median_ms(fns, repeats)
        (loop_ms, loop_cpu), (batched_ms, batched_cpu), (one_ms, one_cpu) = timed[:3]
        reference, got = _numpy_loop(rows, VOCAB), _batched(on_device, VOCAB)
        report[name] = {
            "numpy_loop_ms": round(loop_ms, 3),
            "batched_ms": round(batched_ms, 3),
            "speedup": round(loop_ms / batched_ms, 2),
            "numpy_loop_cpu_ms": round(loop_cpu, 3),
            "batched_cpu_ms": round(batched_cpu, 3),
            "speedup_cpu": round(loop_cpu / batched_cpu, 2),
            "batched_scan_1_thread_ms": round(one_ms, 3),
            "batched_scan_1_thread_cpu_ms": round(one_cpu, 3),
            "speedup_scan_1_thread": round(loop_ms / one_ms, 2),
            "scan_backend": _cpu_scan_backend() if device == "cpu" else "torch",
            **({"batched_numpy_scan_ms": round(timed[3][0], 3), "batched_numpy_scan_cpu_ms": round(timed[3][1], 3),
                "speedup_numpy_scan": round(loop_ms / timed[3][0], 2)} if len(timed) > 3 else {}),
            "agree": sum(a == b for a, b in zip(reference, got)),
            "sampled_positions_decided_by": dict(numerics._SAMPLER.last_paths) if not sampling.greedy else None,
            "mean_accepted": round(float(np.mean([v.num_accepted for v in got if not isinstance(v, str)])), 2),
        }
    return report


def _cpu_scan_backend() -> str:
    from specdec_runtime.cloud_verifier.verdict.scan_native import available

    return "native" if available() else "numpy"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--positions", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--synthetic", action="store_true", help="synthetic logits even when the target is there")
    args = parser.parse_args(argv)
    if min(args.rows, args.positions, args.repeats) < 1:
        parser.error("--rows, --positions and --repeats must be at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    print(json.dumps(bench_verdicts(args.rows, args.positions, args.repeats, args.device, args.synthetic)))


if __name__ == "__main__":
    main()
