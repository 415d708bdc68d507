"""How fast a tensor-parallel replica leaves SERVING when a rank dies: `specdec serve --tensor-parallel N` (the
default target unless --target), --generations concurrent target-only generations over gRPC, then SIGKILL of
rank 1 mid-generation; the health service is polled every --poll-s until it is no longer SERVING (or the server
is gone), and rank 0's exit is awaited. Repeated --runs times (a fresh server each). Prints one JSON line: per run
the seconds from SIGKILL to NOT_SERVING (or unreachable) and to rank 0's exit, and whether a rank process was left.

Usage: python scripts/tensor_parallel_kill_check.py [--runs 3] [--tensor-parallel 2] [--target DIR] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time


def _status(address: str) -> str:
    """SERVING, NOT_SERVING or UNREACHABLE."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _generations(address: str, tokenizer_dir: str, n: int, started: threading.Semaphore) -> list[threading.Thread]:
    from transformers import AutoTokenizer

    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def one(i: int) -> None:
        try:
            with EdgeClient(GrpcBackend(address), None, tok) as client:
                for k, _ in enumerate(client.stream_chunks(f"Story number {i}: once upon a time", max_new_tokens=400,
                                                           ignore_eos=True)):
                    if k == 0:
                        started.release()
        except Exception:  # noqa: BLE001 - the replica goes down under them: expected
            started.release()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _one_run(args, logs: str, run: int) -> dict:
    import psutil

    from specdec.bench.chaos.procs import free_port, stop_process
    from specdec_runtime.common.paths import default_model_paths

    port = free_port()
    address = f"127.0.0.1:{port}"
    log_path = os.path.join(logs, f"run{run}.log")
    env = {**os.environ, "SPECDEC_TORCH_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), "--metrics-port", "0",
           "--tensor-parallel", str(args.tensor_parallel)] + (["--target", args.target] if args.target else [])
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + args.start_timeout_s
        while _status(address) != "SERVING":
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"the server did not start: {log_path}")
            time.sleep(0.5)
        pids = [int(p) for p in re.search(r"started ranks [\d, ]+ \(pids ([\d, ]+)\)", open(log_path).read())
                .group(1).split(", ")]
        started = threading.Semaphore(0)
        _generations(address, args.target or str(default_model_paths().target_dir), args.generations, started)
        for _ in range(args.generations):
            started.acquire(timeout=args.start_timeout_s)
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        status = _status(address)
        while status == "SERVING" and time.monotonic() - killed < 60:
            time.sleep(args.poll_s)
            status = _status(address)
        not_serving = time.monotonic() - killed
        proc.wait(timeout=120)
        exited = time.monotonic() - killed
        time.sleep(1.0)
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        return {"run": run, "kill_to_not_serving_s": round(not_serving, 3), "status_seen": status,
                "kill_to_rank0_exit_s": round(exited, 3), "rank0_exit_code": proc.returncode, "ranks_left": left}
    finally:
        stop_process(proc, timeout_s=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--target", default=None)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--poll-s", type=float, default=0.02)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    args = p.parse_args()
    logs = args.log_dir or tempfile.mkdtemp(prefix="specdec-tp-kill-")
    runs = [_one_run(args, logs, r) for r in range(args.runs)]
    times = [r["kill_to_not_serving_s"] for r in runs]
    print(json.dumps({"tensor_parallel": args.tensor_parallel, "generations": args.generations, "runs": runs,
                      "kill_to_not_serving_max_s": max(times), "loadavg": os.getloadavg()[0], "logs": logs}))


if __name__ == "__main__":
    main()
