#!/usr/bin/env python3
"""Failover and device-fallback demo with the real default models (`specdec models prepare` first).

1. Starts a private redis-server and two `specdec serve` replicas (A, B) sharing it, all on 127.0.0.1.
2. Runs `specdec generate PROMPT --server A,B --temperature 0 --json` and SIGKILLs replica A once it has
   verified a few blocks of it; then runs `specdec generate PROMPT --target-only --temperature 0 --json` and
   compares the token ids.
3. Runs `specdec generate PROMPT --server 127.0.0.1:<closed port> --fallback device --json`, and the same
   without --fallback (expected: exit status 2 and one line on stderr).

Prints each command's exit status, its stderr lines and the JSON fields that matter. Exit status 0 when every
check holds, 1 otherwise. Usage: python scripts/failover_demo.py [--prompt P] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port: int, name: str) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", r.read().decode(), re.M)
        return float(m.group(1)) if m else 0.0
    except OSError:
        return -1.0


def serving(address: str) -> bool:
    run = subprocess.run([sys.executable, "-m", "specdec_runtime.cloud_verifier.serving.healthcheck", "--address", address, "--timeout", "1"],
                         capture_output=True, text=True)
    return run.returncode == 0


def specdec(*args: str, timeout_s: float = 900) -> tuple[int, dict | None, list[str]]:
    run = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", *args], capture_output=True, text=True,
                         timeout=timeout_s, cwd=str(ROOT))
    try:
        out = json.loads(run.stdout) if run.stdout.strip() else None
    except ValueError:
        out = None
    return run.returncode, out, [line for line in run.stderr.splitlines() if line.strip()]


class StartError(RuntimeError):
    """A process of the demo did not start (the message says which, and where its log is)."""


def start_replica(name: str, redis_port: int, work: Path, procs: list, extra_env: dict | None = None):
    """Start `specdec serve` replica ``name`` on free ports, sharing redis; returns (process, address, metrics port)."""
    port, mport = free_port(), free_port()
    env = {**os.environ, "SPECDEC_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
           "SPECDEC_VERIFIER_ID": f"replica-{name}", **(extra_env or {})}
    log = open(work / f"replica-{name}.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--host", "127.0.0.1", "--port",
                          str(port), "--metrics-port", str(mport)], stdout=log, stderr=subprocess.STDOUT,
                         env=env, cwd=str(ROOT))
    procs.append(p)
    return p, f"127.0.0.1:{port}", mport


def wait_serving(name: str, p: subprocess.Popen, address: str, deadline: float, work: Path) -> None:
    """Wait until replica ``name`` answers its health check. Raises StartError if it exits or ``deadline`` passes."""
    while not serving(address):
        if p.poll() is not None or time.monotonic() > deadline:
            raise StartError(f"replica {name} did not start; see {work}")
        time.sleep(0.5)


def kill_mid_run(args, proc_a, addr_a: str, mport_a: int, addr_b: str, mport_b: int) -> tuple[bool, dict | None]:
    """Check 1: `specdec generate --server A,B` with A SIGKILLed mid-run equals --target-only. Returns (ok, the
    target-only JSON)."""
    drafts0 = metric(mport_a, "specdec_spec_decode_num_drafts_total")
    cmd = ["generate", args.prompt, "--server", f"{addr_a},{addr_b}", "--temperature", "0",
           "--max-new-tokens", str(args.max_new_tokens), "--json"]
    print("\n$ specdec " + " ".join(repr(c) if " " in c else c for c in cmd) + "   # SIGKILL A mid-run")
    gen = subprocess.Popen([sys.executable, "-m", "specdec.cli", *cmd], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    while gen.poll() is None and metric(mport_a, "specdec_spec_decode_num_drafts_total") - drafts0 < 5:
        time.sleep(0.02)
    killed_at = metric(mport_a, "specdec_spec_decode_num_drafts_total") - drafts0
    proc_a.send_signal(signal.SIGKILL)
    stdout, stderr = gen.communicate(timeout=900)
    failover = json.loads(stdout) if gen.returncode == 0 else None
    print(f"A SIGKILLed after verifying {killed_at:.0f} blocks of it; exit status {gen.returncode}")
    for line in stderr.splitlines():
        print(f"  stderr: {line}")
    if failover:
        print("  " + json.dumps({k: failover[k] for k in ("num_generated_tokens", "num_failovers",
                                                          "num_unverified_tokens", "finish_reason",
                                                          "acceptance_rate", "elapsed_s")}))
        print(f"  B resumed sessions: {metric(mport_b, 'specdec_sessions_resumed_total'):.0f}")
    rc, ref, err = specdec(args.prompt, "--target-only", "--temperature", "0", "--max-new-tokens",
                           str(args.max_new_tokens), "--json")
    print(f"\n$ specdec generate ... --target-only --temperature 0 --json   -> exit status {rc}")
    same = bool(failover and ref and failover["token_ids"] == ref["token_ids"])
    print(f"  token ids identical to --target-only: {same} ({len(ref['token_ids']) if ref else 0} tokens)")
    return gen.returncode == 0 and bool(failover) and failover["num_failovers"] >= 1 and same, ref


def sdk_failover(args, redis_port: int, work: Path, procs: list, addr_b: str, ref: dict | None) -> bool:
    """Check 1b: the SDK, to time the failover: a fresh replica A2 first in the list, SIGKILLed after 20 chunks."""
    proc_a2, addr_a2, _ = start_replica("a2", redis_port, work, procs)
    while not serving(addr_a2):
        if proc_a2.poll() is not None:
            raise StartError("replica a2 did not start")
        time.sleep(0.5)
    sys.path.insert(0, str(ROOT))
    from specdec_runtime.edge_client.client import EdgeClient

    with EdgeClient.connect([addr_a2, addr_b]) as client:
        chunks = client.stream_chunks(args.prompt, max_new_tokens=args.max_new_tokens, temperature=0.0)
        for _ in range(20):
            next(chunks)
        proc_a2.send_signal(signal.SIGKILL)
        list(chunks)
        res = client.last_result
        print(f"\nSDK EdgeClient.connect([A2, B]), A2 SIGKILLed after 20 chunks: num_failovers {res.num_failovers}, "
              f"token ids identical to --target-only: {bool(ref) and res.token_ids == ref['token_ids']}")
        print("  failover time, first failure -> verdict: "
              + ", ".join(f"{m:.0f} ms" for m in client.backend.last_failover_ms)
              + "; retry sent -> verdict: " + ", ".join(f"{m:.0f} ms" for m in client.backend.last_retry_ms))
    return res.num_failovers >= 1 and bool(ref) and res.token_ids == ref["token_ids"]


def closed_port(args) -> bool:
    """Check 2: a closed port: device fallback (every token unverified, one notice), and none (exit 2, one line)."""
    closed = f"127.0.0.1:{free_port()}"
    rc, out, err = specdec(args.prompt, "--server", closed, "--fallback", "device", "--temperature", "0",
                           "--max-new-tokens", str(args.max_new_tokens), "--json")
    print(f"\n$ specdec generate PROMPT --server {closed} --fallback device --json   -> exit status {rc}")
    for line in err:
        print(f"  stderr: {line}")
    if out:
        print("  " + json.dumps({k: out[k] for k in ("num_generated_tokens", "num_unverified_tokens",
                                                     "num_failovers", "finish_reason")}))
    ok = rc == 0 and bool(out) and out["num_unverified_tokens"] == out["num_generated_tokens"] and len(err) == 1
    rc, out, err = specdec(args.prompt, "--server", closed, "--temperature", "0", "--json")
    print(f"\n$ specdec generate PROMPT --server {closed} --json   -> exit status {rc}")
    for line in err:
        print(f"  stderr: {line}")
    return ok and rc == 2 and len(err) == 1


def stop_all(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="Explain how a rainbow forms, step by step.")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    binary = shutil.which("redis-server")
    if binary is None:
        print("error: redis-server not found", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="specdec-failover-"))
    procs: list[subprocess.Popen] = []
    try:
        redis_port = free_port()
        procs.append(subprocess.Popen([binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no"], stdout=subprocess.DEVNULL))
        replicas = [(name, *start_replica(name, redis_port, work, procs, {"SPECDEC_GRACE_PERIOD_S": "5"}))
                    for name in ("a", "b")]
        deadline = time.monotonic() + 300
        for name, p, address, _ in replicas:
            wait_serving(name, p, address, deadline, work)
        (_, proc_a, addr_a, mport_a), (_, _, addr_b, mport_b) = replicas
        print(f"replicas: A={addr_a} B={addr_b} (redis 127.0.0.1:{redis_port}); logs in {work}")
        ok, ref = kill_mid_run(args, proc_a, addr_a, mport_a, addr_b, mport_b)
        ok &= sdk_failover(args, redis_port, work, procs, addr_b, ref)
        ok &= closed_port(args)
    except StartError as e:
        print(str(e), file=sys.stderr)
        return 1
    finally:
        stop_all(procs)
    print(f"\nall checks hold: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
