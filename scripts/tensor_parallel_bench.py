"""Tensor parallel vs one device on this machine: step time, all-reduce share, token identity. Prints JSON.

Loads the default target (or --target) twice: on one rank (TP=1, ``--threads-tp1`` torch threads) and sharded
over N gloo ranks (this process is rank 0, N-1 spawned; ``--threads-per-rank`` each), both on the CPU unless
--device cuda (then TP=N runs NCCL on cuda:0..N-1 and TP=1 on cuda:0). Then:

1. step time: the median of ``--steps`` forward passes of a decode step (1 row, 1 token) and of a verify batch
   (8 rows of 5 tokens, 64 committed positions each), on each runner; TP=N also its all-reduce time (rank 0's
   wall time inside ``all_reduce``) and its share of the step;
2. identity over real gRPC (an EmbeddedServer per runner): ``--prompts`` greedy generations of ``--new-tokens``
   target-only (the path of ``specdec generate --target-only``) at TP=1 against TP=N target-only and TP=N
   speculative (the default ONNX draft); ``--sessions`` concurrent speculative sessions at TP=N against TP=1
   target-only; one seeded sampled generation (temperature 0.8, seed 7) at TP=N against TP=1, with the largest
   |logit difference| of TP=N vs TP=1 on its tokens when they differ.

Usage: python scripts/tensor_parallel_bench.py [--tensor-parallel 2] [--steps 20] [--prompts 6] [--new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

PROMPTS = ["Explain how a rainbow forms.", "Write a short poem about the sea.", "What is the capital of France and why?",
           "List three uses of a paperclip.", "Describe a cat to someone who has never seen one.",
           "How do airplanes stay in the air?", "Give me a recipe for pancakes.", "What is speculative decoding?"]


def _runners(args):
    import torch

    from specdec_runtime.cloud_verifier.parallel import RankSpec, start_parallel_runner
    from specdec.bench.chaos.procs import free_port
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.common.paths import default_model_paths

    target = args.target or str(default_model_paths().target_dir)
    tp = start_parallel_runner(RankSpec(target, args.tensor_parallel, f"tcp://127.0.0.1:{free_port()}", args.device,
                                        "float32", 65536, 16, args.threads_per_rank))
    torch.set_num_threads(args.threads_tp1)
    one = TargetRunner(target, kv_cache_budget_tokens=65536, device="cuda:0" if args.device == "cuda" else "cpu",
                       num_threads=args.threads_tp1)
    return target, one, tp


def _step_times(runner, steps: int, rows: int, tokens: int) -> dict:
    import torch

    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow

    kvs = [runner.allocate(128) for _ in range(rows)]
    try:
        for kv in kvs:  # 64 committed positions per row
            runner.forward([ForwardRow(kv, list(range(100, 164)), 0, "none")])
        times, reduce = [], []
        parallel = getattr(runner, "parallel", None)
        for i in range(steps + 2):
            batch = [ForwardRow(kv, [300 + i] * tokens, 64, "all") for kv in kvs]
            start = time.perf_counter()
            runner.forward(batch)
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:  # two warm-up passes
                times.append(time.perf_counter() - start)
                reduce.append(parallel.last_allreduce_s if parallel else 0.0)
    finally:
        for kv in kvs:
            runner.free(kv)
    step, red = statistics.median(times), statistics.median(reduce)
    return {"rows": rows, "tokens_per_row": tokens, "step_ms": round(step * 1e3, 2),
            **({"allreduce_ms": round(red * 1e3, 2), "allreduce_share": round(red / step, 3)} if parallel else {})}


def _generate(address, tokenizer_dir, prompts, new_tokens, draft_dir=None, **sampling):
    """Token ids of each prompt, generated concurrently (one thread and client per prompt) over gRPC."""
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out: dict[int, list[int]] = {}

    def one(i):
        drafter = ModelDrafter(OnnxDraftModel(draft_dir, intra_op_num_threads=1)) if draft_dir else None
        with EdgeClient(GrpcBackend(address), drafter, tok, num_speculative_tokens=4) as client:
            res = client.generate(prompts[i], max_new_tokens=new_tokens, ignore_eos=True, **sampling)
            out[i] = (res.prompt_token_ids, res.token_ids)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [out.get(i) for i in range(len(prompts))]


def _logits(runner, ids: list[int]):
    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow

    kv = runner.allocate(len(ids))
    try:
        return runner.forward([ForwardRow(kv, ids, 0, "all")])[0]
    finally:
        runner.free(kv)


def _logit_diff(one, tp, ids: list[int]) -> float:
    """Largest |logit| difference of the two runners over a sequence."""
    import numpy as np

    return float(np.abs(_logits(one, ids) - _logits(tp, ids)).max())


def _mismatch(one, tp, prompt: list[int], ref: list[int], got: list[int]) -> dict:
    """Where two generations part: the first differing position, the two tokens, TP=1's top-2 logit gap there
    (both runners, one sequence each, no batching) and the largest |logit| difference of the runners there."""
    import numpy as np

    pos = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if pos is None:  # the same tokens after a different prompt (tokenization, not verification)
        return {"prompt_differs": True}
    rows = [_logits(r, prompt + ref[:pos])[-1] for r in (one, tp)]
    top2 = np.sort(rows[0])[-2:]
    return {"position": pos, "tp1_token": ref[pos], "tpN_token": got[pos],
            "tp1_top2_gap": float(top2[1] - top2[0]), "argmax_tp1": int(rows[0].argmax()),
            "argmax_tpN": int(rows[1].argmax()), "max_logit_diff": float(np.abs(rows[0] - rows[1]).max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--target", default=None)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads-tp1", type=int, default=os.cpu_count() or 1)
    p.add_argument("--threads-per-rank", type=int, default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--skip-identity", action="store_true")
    p.add_argument("--control", action="store_true", help="also the concurrent speculative sessions at TP=1")
    args = p.parse_args()
    args.threads_per_rank = args.threads_per_rank or max(1, (os.cpu_count() or 1) // args.tensor_parallel)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    target, one, tp = _runners(args)
    report = {"target": os.path.basename(target.rstrip("/")), "device": args.device, "cpus": os.cpu_count(),
              "loadavg_at_start": os.getloadavg()[0],
              "tensor_parallel": args.tensor_parallel, "threads_tp1": args.threads_tp1,
              "threads_per_rank": args.threads_per_rank,
              "per_rank": [{"weight_bytes": s["weight_bytes"], "kv_bytes": s["kv_bytes"]} for s in tp.parallel.per_rank]}
    try:
        from specdec_runtime.cloud_verifier.parallel.sharding import weight_bytes

        report["tp1_weight_bytes"] = weight_bytes(one.model)
        report["steps"] = {}
        for name, rows, n in (("decode", 1, 1), ("verify_8x5", 8, 5)):
            torch.set_num_threads(args.threads_tp1)  # one process holds both runners: torch's threads are global
            tp1 = _step_times(one, args.steps, rows, n)
            torch.set_num_threads(args.threads_per_rank)
            report["steps"][name] = {"tp1": tp1, "tpN": _step_times(tp, args.steps, rows, n)}
        if not args.skip_identity:
            report["identity"] = _identity(args, target, one, tp)
        report["loadavg_at_end"] = os.getloadavg()[0]
    finally:
        tp.parallel.close()
    print(json.dumps(report))  # one line: scripts/gpu_check.sh reads the last JSON line


def _identity(args, target, one, tp) -> dict:
    from specdec.embedded import EmbeddedServer
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.common.paths import default_model_paths

    draft = str(default_model_paths().draft_dir)
    prompts = (PROMPTS * 4)[: max(args.prompts, args.sessions)]
    v1, vn = (Verifier(r, max_num_speculative_tokens=8, cost_table_dir=False) for r in (one, tp))
    with EmbeddedServer(verifier=v1) as a1, EmbeddedServer(verifier=vn) as an:
        start = time.perf_counter()
        ref = _generate(a1, target, prompts, args.new_tokens)
        t_ref = time.perf_counter() - start
        n = args.prompts
        plain_n = _generate(an, target, prompts[:n], args.new_tokens)
        spec_n = _generate(an, target, prompts[: args.sessions], args.new_tokens, draft_dir=draft)
        sampled = [_generate(a, target, prompts[:1], args.new_tokens, temperature=0.8, seed=7)[0] for a in (a1, an)]
        # the control: the same concurrent speculative sessions on one device
        spec_1 = _generate(a1, target, prompts[: args.sessions], args.new_tokens, draft_dir=draft) if args.control else None
    # prompts repeat past 8: a session and its twin differ only in what shared their forward passes
    same = lambda a, b: a == b  # noqa: E731 - prompt and generated ids (a garbled prompt is not a verify fault)
    out = {"prompts": n, "new_tokens": args.new_tokens, "tp1_target_only_s": round(t_ref, 1),
           "tpN_target_only_identical": sum(same(plain_n[i], ref[i]) for i in range(n)),
           "tpN_speculative_identical": sum(same(spec_n[i], ref[i]) for i in range(n)),
           "concurrent_sessions": args.sessions,
           "concurrent_speculative_identical": sum(same(spec_n[i], ref[i]) for i in range(args.sessions)),
           "seeded_sample_identical": same(*sampled)}
    if spec_1 is not None:
        out["control_tp1_concurrent_speculative_identical"] = sum(same(spec_1[i], ref[i]) for i in range(args.sessions))
    out["mismatches"] = {f"{kind}[{i}]": _mismatch(one, tp, got[i][0], ref[i][1], got[i][1])
                         for kind, got, m in (("target_only", plain_n, n), ("speculative", spec_n, args.sessions))
                         for i in range(m) if not same(got[i], ref[i])}
    if not out["seeded_sample_identical"]:
        out["seeded_sample_max_logit_diff"] = _logit_diff(one, tp, sampled[0][0] + sampled[0][1])
    return out


if __name__ == "__main__":
    main()
