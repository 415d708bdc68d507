"""`specdec serve --tensor-parallel N` against `specdec serve` (TP=1) with the default target, through the CLI and
real gRPC: greedy `specdec generate` of each prompt (96 tokens, EOS ignored) speculative and --target-only on the
TP=N replica, compared with --target-only on the TP=1 replica; one seeded sampled generation (temperature 0.8, seed
7) on both. Prints one JSON line (counts of identical generations). Both servers are started and stopped here,
on free ports of 127.0.0.1 (logs under --log-dir).

Usage: python scripts/tensor_parallel_serve_check.py [--tensor-parallel 2] [--new-tokens 96] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPTS = ["Explain how a rainbow forms.", "Write a short poem about the sea.", "What is the capital of France and why?",
           "List three uses of a paperclip.", "Describe a cat to someone who has never seen one.",
           "How do airplanes stay in the air?"]


def _healthy(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING


def main() -> None:
    from specdec.bench.chaos.procs import free_port, stop_process

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    args = p.parse_args()
    logs = args.log_dir or tempfile.mkdtemp(prefix="specdec-tp-check-")
    env = {**os.environ, "SPECDEC_TORCH_THREADS": os.environ.get("SPECDEC_TORCH_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    ports = {"tpN": free_port(), "tp1": free_port()}
    cli = [sys.executable, "-m", "specdec.cli"]
    procs = [subprocess.Popen(cli + ["serve", "--port", str(ports[name]), "--metrics-port", "0", *extra],
                              stdout=open(os.path.join(logs, f"{name}.log"), "w"), stderr=subprocess.STDOUT, env=env)
             for name, extra in (("tpN", ["--tensor-parallel", str(args.tensor_parallel)]), ("tp1", []))]
    try:
        deadline = time.monotonic() + args.start_timeout_s
        for port in ports.values():
            while not _healthy(f"127.0.0.1:{port}"):
                if time.monotonic() > deadline or any(pr.poll() is not None for pr in procs):
                    raise SystemExit(f"a server did not start: logs in {logs}")
                time.sleep(1)

        def gen(name: str, prompt: str, *extra: str) -> list[int]:
            out = subprocess.run(cli + ["generate", "--server", f"127.0.0.1:{ports[name]}", "--max-new-tokens",
                                        str(args.new_tokens), "--ignore-eos", "--json", *extra, prompt],
                                 capture_output=True, text=True, env=env, timeout=900)
            return json.loads(out.stdout.strip().splitlines()[-1])["token_ids"]

        res = {"tensor_parallel": args.tensor_parallel, "prompts": len(PROMPTS), "new_tokens": args.new_tokens,
               "tpN_speculative_identical": 0, "tpN_target_only_identical": 0}
        for prompt in PROMPTS:
            ref = gen("tp1", prompt, "--target-only")
            res["tpN_target_only_identical"] += gen("tpN", prompt, "--target-only") == ref
            res["tpN_speculative_identical"] += gen("tpN", prompt) == ref
        sampled = [gen(name, PROMPTS[0], "--temperature", "0.8", "--seed", "7") for name in ("tpN", "tp1")]
        res["seeded_sampled_identical"] = sampled[0] == sampled[1]
        res["logs"] = logs
        print(json.dumps(res))
    finally:
        for pr in procs:
            stop_process(pr, timeout_s=30)


if __name__ == "__main__":
    main()
