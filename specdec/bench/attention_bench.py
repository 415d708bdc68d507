"""One target forward pass of many verify rows: the paged one-call-per-layer attention against the per-row
reference loop it replaced, side by side in one run. Prints one JSON line.

    python -m specdec.bench.attention_bench --rows 64 --tokens 5 --context 300 --repeats 7

Each of ``--rows`` sessions holds ``--context`` tokens of KV (prefilled once, untimed), then one forward pass
of ``--rows`` verify rows of ``--tokens`` tokens each is timed ``--repeats`` times per mode (modes alternate, so
a slow patch of a shared machine hits both alike); medians in ms. ``--page-sizes 16,32`` times the paged path
at several KV page sizes (a runner each). Default target: the prepared SmolLM2-135M.

The code before the paged pool (a worktree of an older commit) is timed by running this file with that tree
first on PYTHONPATH: ``PYTHONPATH=/tmp/before python specdec/bench/attention_bench.py ...`` (``forward_ms``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _time_forward(runner, rows, repeats: int) -> dict:
    """Median ms of the reference loop and of the paged path over ``rows``, alternating (a runner from before
    the paged pool, run through PYTHONPATH: its one forward as ``forward_ms``)."""
    import torch

    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    if not hasattr(runner, "reference_attention"):  # the code before the paged pool
        runner.forward(rows)
        times = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            runner.forward(rows)
            sync()
            times.append((time.perf_counter() - t) * 1000)
        return {"forward_ms": statistics.median(times)}
    times: dict[str, list[float]] = {"reference": [], "paged": []}
    runner.forward(rows)  # warm-up (both modes)
    with runner.reference_attention():
        runner.forward(rows)
    for r in range(repeats):
        for mode in (("paged", "reference") if r % 2 == 0 else ("reference", "paged")):
            sync()
            t = time.perf_counter()
            if mode == "reference":
                with runner.reference_attention():
                    runner.forward(rows, as_tensors=True)
            else:
                runner.forward(rows, as_tensors=True)
            sync()
            times[mode].append((time.perf_counter() - t) * 1000)
    return {f"{m}_ms": statistics.median(v) for m, v in times.items()}


def run(target: str | None, rows: int, tokens: int, context: int, repeats: int, page_size: int, device: str,
        dtype: str) -> dict:
    """One runner, ``rows`` sessions of ``context`` tokens; the timings and what was timed."""
    import numpy as np

    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow

    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.common.paths import default_model_paths

    import inspect

    budget = rows * (context + tokens + 2 * page_size)
    # an older tree (timed by this file, see above) may call the page size kv_block_size or have no paged pool
    size_arg = next((a for a in ("kv_page_size", "kv_block_size") if a in inspect.signature(TargetRunner).parameters),
                    None)
    paged = size_arg is not None
    runner = TargetRunner(target or default_model_paths().target_dir, kv_cache_budget_tokens=budget,
                          device=device, dtype=dtype, check_architecture=False,
                          **({size_arg: page_size} if paged else {}))
    rng = np.random.default_rng(0)
    vocab = min(runner.vocab_size, 32000)
    kvs = [runner.allocate(context + tokens) for _ in range(rows)]
    try:
        for i in range(0, rows, 8):  # prefill, untimed, 8 sessions per forward pass
            runner.forward([ForwardRow(kv, rng.integers(3, vocab, context - 1).tolist(), 0, "none")
                            for kv in kvs[i : i + 8]])
        verify = [ForwardRow(kv, rng.integers(3, vocab, tokens).tolist(), context - 1, "all") for kv in kvs]
        result = _time_forward(runner, verify, repeats)
    finally:
        for kv in kvs:
            runner.free(kv)
    result.update(page_size=page_size if paged else None, device=str(runner.device),
                  dtype=str(runner.dtype).removeprefix("torch."), num_layers=runner.num_layers)
    if paged:
        result["speedup"] = result["reference_ms"] / result["paged_ms"]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="HF target directory (default: the prepared SmolLM2)")
    parser.add_argument("--rows", type=int, default=64, help="verify rows (sessions) in the forward pass")
    parser.add_argument("--tokens", type=int, default=5, help="tokens per verify row (γ + 1)")
    parser.add_argument("--context", type=int, default=300, help="KV tokens each session holds before its row")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--page-sizes", default="16", help="comma-separated KV page sizes, tokens")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    import torch

    out = {"rows": args.rows, "tokens": args.tokens, "context": args.context, "repeats": args.repeats,
           "torch_threads": torch.get_num_threads(), "results": []}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    for bs in (int(b) for b in args.page_sizes.split(",")):
        out["results"].append(run(args.target, args.rows, args.tokens, args.context, args.repeats, bs,
                                  args.device, args.dtype))
        print(json.dumps(out), flush=True)  # partial results survive a cut-short run


if __name__ == "__main__":
    main()
