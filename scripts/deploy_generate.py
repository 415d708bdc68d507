#!/usr/bin/env python3
"""The generations of scripts/deploy_check.sh against a running compose stack (host networking,
deploy/compose.host.yml): each runs in the edge image (`compose run edge-demo specdec generate --server BALANCER
--temperature 0 --json`) and its token ids are compared with `specdec generate --target-only` in the verifier
image. Standard library only (it runs on the host's python3).

  reference          the target-only token ids, saved to --reference
  replica-failover   a generation through the balancer with both replicas up; one with the replica serving it
                     SIGKILLed (`compose kill`) after it verified a few blocks, finished on the survivor (which
                     resumed the session from Redis); one more with the survivor alone
  store-failover     a generation with the Redis master container SIGKILLed mid-run (profile "sentinel")

Exit status 0 when every generation is token-identical to the reference (and the failovers happened), 1 otherwise.
Usage: scripts/deploy_generate.py MODE --compose 'docker-compose -p P -f ...' [--prompt P] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request

BALANCER = "127.0.0.1:50060"  # deploy/compose.host.yml
METRICS = {"verifier": 19090, "verifier-b": 19091}
DRAFTS = "specdec_spec_decode_num_drafts_total"
RESUMED = "specdec_sessions_resumed_total"
STORE_FAILOVERS = "specdec_store_failovers_total"


def metric(port: int, name: str) -> float:
    """A counter of the replica's /metrics (the sum over its labels); -1 when the replica does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
            text = r.read().decode()
    except OSError:
        return -1.0
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE))


def generate_cmd(compose: list[str], args, service: str, *extra: str) -> list[str]:
    return [*compose, "run", "--rm", "--no-deps", "-T", service, "specdec", "generate", args.prompt,
            "--temperature", "0", "--max-new-tokens", str(args.max_new_tokens), "--json", *extra]


def finish(proc: subprocess.Popen, label: str, reference: list[int] | None) -> dict | None:
    """Wait for a generation, print its summary; None when it failed or differs from ``reference``."""
    stdout, stderr = proc.communicate(timeout=900)
    out = None
    if proc.returncode == 0:
        try:
            out = json.loads(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out = None
    if out is None:
        print(f"{label}: FAILED (exit status {proc.returncode})\n{stderr[-3000:]}")
        return None
    same = reference is None or out["token_ids"] == reference
    verdict = "the reference" if reference is None else f"token-identical to --target-only: {same}"
    rate = "-" if out["acceptance_rate"] is None else f"{out['acceptance_rate']:.2f}"
    print(f"{label}: {out['num_generated_tokens']} tokens in {out['elapsed_s']:.1f} s, failovers "
          f"{out['num_failovers']}, acceptance rate {rate}, {verdict}")
    return out if same else None


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def reference(compose: list[str], args) -> int:
    # `docker run`, not `compose run`: a one-off container of a running service is linked to it, and links are
    # refused on the host network
    cmd = ["docker", "run", "--rm", "--network", "host", "-v", f"{args.models}:/opt/specdec/models:ro",
           "specdec-verifier:latest", *generate_cmd([], args, "", "--target-only")[5:]]
    out = finish(start(cmd), "target-only (verifier image)", None)
    if out is None:
        return 1
    with open(args.reference, "w", encoding="utf-8") as f:
        json.dump(out["token_ids"], f)
    print(f"  {out['text'][:120]!r}")
    return 0


def kill_when(compose: list[str], proc: subprocess.Popen, ports: dict[str, int], service_of, blocks: int) -> str:
    """SIGKILL (`compose kill`) the service ``service_of(replica)`` once a replica verified ``blocks`` blocks of the
    running generation; returns the replica that served it (bounded: the generation's own end stops the wait)."""
    base = {name: metric(port, DRAFTS) for name, port in ports.items()}
    serving = ""
    while proc.poll() is None and not serving:
        for name, port in ports.items():
            if metric(port, DRAFTS) - base[name] >= blocks:
                serving = name
        time.sleep(0.05)
    if not serving:
        return ""
    victim = service_of(serving)
    subprocess.run([*compose, "kill", victim], check=True, capture_output=True, timeout=60)
    print(f"  {serving} served it; `compose kill {victim}` after {blocks} verified blocks")
    return serving


def replica_failover(compose: list[str], args, ref: list[int]) -> int:
    cmd = generate_cmd(compose, args, "edge-demo", "--server", BALANCER)
    ok = finish(start(cmd), "through the balancer, both replicas up", ref) is not None
    resumed0 = {name: metric(port, RESUMED) for name, port in METRICS.items()}
    proc = start(cmd)
    killed = kill_when(compose, proc, METRICS, lambda replica: replica, args.kill_after_blocks)
    out = finish(proc, "through the balancer, the serving replica SIGKILLed mid-run", ref)
    survivor = next((n for n in METRICS if n != killed), "")
    resumed = metric(METRICS[survivor], RESUMED) - resumed0[survivor] if survivor else 0
    print(f"  the survivor {survivor} resumed {resumed:.0f} session(s) from Redis")
    # the session finished on the survivor: the client retried it there, or nginx sent its next call there at once
    # (a fast generation can lose its replica between two calls: no failed call for the client to count)
    ok &= bool(killed) and out is not None and resumed >= 1
    ok &= finish(start(cmd), f"through the balancer, {survivor} alone", ref) is not None
    return 0 if ok else 1


def store_failover(compose: list[str], args, ref: list[int]) -> int:
    cmd = generate_cmd(compose, args, "edge-demo", "--server", BALANCER)
    proc = start(cmd)
    killed = kill_when(compose, proc, METRICS, lambda replica: "redis-primary", args.kill_after_blocks)
    out = finish(proc, "through the balancer, the Redis master SIGKILLed mid-run", ref)
    moved = sum(max(metric(port, STORE_FAILOVERS), 0) for port in METRICS.values())
    print(f"  store calls that ended on the promoted master: {moved:.0f}")
    return 0 if killed and out is not None and moved >= 1 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["reference", "replica-failover", "store-failover"])
    ap.add_argument("--compose", required=True, help="the compose command line, with its -p and -f options")
    ap.add_argument("--reference", required=True, help="JSON file of the target-only token ids")
    ap.add_argument("--models", default=os.environ.get("SPECDEC_MODELS_DIR", ""),
                    help="the prepared models, mounted into the verifier image (default $SPECDEC_MODELS_DIR)")
    ap.add_argument("--prompt", default="Explain how a rainbow forms, step by step.")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--kill-after-blocks", type=int, default=5)
    args = ap.parse_args()
    compose = shlex.split(args.compose)
    if args.mode == "reference":
        return reference(compose, args)
    with open(args.reference, encoding="utf-8") as f:
        ref = json.load(f)
    return (replica_failover if args.mode == "replica-failover" else store_failover)(compose, args, ref)


if __name__ == "__main__":
    sys.exit(main())
