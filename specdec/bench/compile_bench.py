"""Eager vs compiled target forward (``compile_mode``, :mod:`cloud_verifier.target.compiled_forward`), side by side in
one process. Prints one JSON line per row count.

    python -m specdec.bench.compile_bench --rows 16,64 --tokens 5 --context 300 --repeats 5 --layers 4

Two runners on the same weights (eager, and ``--mode``), ``--rows`` sessions of ``--context`` tokens each
(prefilled, untimed); per row count: the first compiled pass (the compilation, ``compile_s``), then
``--repeats`` timed passes per runner, alternating (medians, ms), the largest logit difference to eager, and
dynamo's compile count before and after a pass with other shapes (``recompiled``: a pass of rows-1 rows 3 tokens
at a later position). ``--layers N`` runs a copy of the target cut to its first N layers (weights linked, not
copied): a whole-model compilation of all layers takes many minutes on a small CPU; per-layer cost scales.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _truncated(target: Path, layers: int | None, root: Path) -> Path:
    """``target`` itself, or a directory linking its files with a config of ``layers`` layers."""
    if not layers:
        return target
    out = root / f"{target.name}-{layers}l"
    out.mkdir()
    for f in target.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = int(layers)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _compiles() -> int:
    import torch._dynamo.utils as du

    return int(du.counters["stats"]["unique_graphs"])


def _timed(runner, rows, sync) -> tuple[float, list]:
    sync()
    t = time.perf_counter()
    out = runner.forward(rows, as_tensors=True)
    sync()
    return (time.perf_counter() - t) * 1000, out


def _session_rows(runner, rng, num, context, vocab):
    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow

    kvs = [runner.allocate(context + 32) for _ in range(num)]
    prompts = [rng.integers(3, vocab, context - 1).tolist() for _ in range(num)]
    for i in range(0, num, 8):
        runner.forward([ForwardRow(kv, p, 0, "none") for kv, p in zip(kvs[i : i + 8], prompts[i : i + 8])])
    return kvs


def measure(runners, num_rows, tokens, context, repeats, seed=0) -> dict:
    """Timings of one row count (both runners hold identical sessions)."""
    import numpy as np
    import torch

    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow

    eager, compiled = runners
    sync = torch.cuda.synchronize if eager.device.type == "cuda" else (lambda: None)
    vocab = min(eager.vocab_size, 32000)
    kvs = [_session_rows(r, np.random.default_rng(seed), num_rows, context, vocab) for r in runners]
    draft = np.random.default_rng(seed + 1).integers(3, vocab, (num_rows, tokens)).tolist()
    rows = [[ForwardRow(kv, d, context - 1, "all") for kv, d in zip(k, draft)] for k in kvs]
    before = _compiles()
    compile_ms, _ = _timed(compiled, rows[1], sync)
    times = {"eager": [], "compiled": []}
    for r in range(repeats):
        for which in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            i = 0 if which == "eager" else 1
            ms, out = _timed(runners[i], rows[i], sync)
            times[which].append(ms)
            if which == "compiled":
                last_compiled = out
            else:
                last_eager = out
    diff = max(float((a - b).abs().max()) for a, b in zip(last_eager, last_compiled))
    after_first = _compiles()
    other = [ForwardRow(kv, d[:3], context - 1 + tokens, "all") for kv, d in zip(kvs[1][:-1], draft)]
    other_ms, _ = _timed(compiled, other, sync)
    for r, k in zip(runners, kvs):
        for kv in k:
            r.free(kv)
    result = {"rows": num_rows, "first_pass_ms": compile_ms, "eager_ms": statistics.median(times["eager"]),
              "compiled_ms": statistics.median(times["compiled"]), "max_abs_logit_diff": diff,
              "graphs_compiled_first_shape": after_first - before, "other_shape_ms": other_ms,
              "recompiled_on_other_shape": _compiles() > after_first}
    result["speedup"] = result["eager_ms"] / result["compiled_ms"]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="HF target directory (default: the prepared SmolLM2)")
    parser.add_argument("--mode", default="torch_compile", choices=("torch_compile", "cuda_graphs"))
    parser.add_argument("--rows", default="16,64", help="comma-separated verify row counts")
    parser.add_argument("--tokens", type=int, default=5, help="tokens per verify row (γ + 1)")
    parser.add_argument("--context", type=int, default=300, help="KV tokens each session holds before its row")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=None, help="cut the target to its first N layers")
    parser.add_argument("--static", action="store_true", help="torch.compile(dynamic=False): a graph per shape")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    import torch

    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.common.paths import default_model_paths

    row_counts = [int(r) for r in args.rows.split(",")]
    budget = max(row_counts) * (args.context + 64)
    with tempfile.TemporaryDirectory() as tmp:
        target = _truncated(Path(args.target or default_model_paths().target_dir), args.layers, Path(tmp))
        runners = [TargetRunner(target, kv_cache_budget_tokens=budget, device=args.device, dtype=args.dtype,
                                compile_mode=mode) for mode in ("off", args.mode)]
        out = {"mode": args.mode, "tokens": args.tokens, "context": args.context, "repeats": args.repeats,
               "layers": runners[0].num_layers, "torch": torch.__version__, "device": str(runners[0].device),
               "dtype": str(runners[0].dtype).removeprefix("torch."), "torch_threads": torch.get_num_threads(),
               "active_mode": runners[1]._compiled.mode, "dynamic": not args.static, "results": []}
        if args.static and args.mode == "torch_compile":
            from specdec_runtime.cloud_verifier.target.compiled_forward import CompiledForward

            keys = runners[1]._compiled.plan_keys
            runners[1]._compiled = CompiledForward(runners[1], "torch_compile", dynamic=False)
            runners[1]._compiled.plan_keys = keys
        for n in row_counts:
            out["results"].append(measure(runners, n, args.tokens, args.context, args.repeats))
            print(json.dumps(out), flush=True)  # partial results survive a cut-short run


if __name__ == "__main__":
    main()
