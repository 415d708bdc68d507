"""``python -m specdec.netem``: run a :class:`~specdec.netem.WanProxy` by hand, printing its counters.

Example (a 50 ms one-way WAN with ±10 ms jitter, 2 Mbit/s, 5 % stalls of 200 ms, a reset a minute)::

    python -m specdec.netem --upstream 127.0.0.1:50051 --listen 50052 --latency-ms 50 --jitter-ms 10 \\
        --bandwidth-kbps 2000 --stall-probability 0.05 --stall-ms 200 --resets-per-minute 1 --seed 7
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from specdec.netem.proxy import DirectionProfile, LinkProfile, WanProxy


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specdec.netem", description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True, help="host:port of the real server")
    p.add_argument("--listen", type=int, default=0, help="port to listen on (0: a free one, printed)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="one-way delay per direction, ms")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform ± jitter of that delay, ms")
    p.add_argument("--bandwidth-kbps", type=float, default=0.0, help="cap per direction, kbit/s (0: none)")
    p.add_argument("--stall-probability", type=float, default=0.0, help="per chunk, in [0, 1]")
    p.add_argument("--stall-ms", type=float, default=0.0, help="length of a stall, ms")
    p.add_argument("--downlink-latency-ms", type=float, default=None,
                   help="one-way delay upstream → client instead of --latency-ms, ms")
    p.add_argument("--resets-per-minute", type=float, default=0.0, help="mean rate of connection resets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-s", type=float, default=10.0, help="print the counters every this many s (0: never)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run until SIGINT / SIGTERM; returns the exit status (2 on a bad argument)."""
    args = _parser().parse_args(argv)
    up = DirectionProfile(args.latency_ms, args.jitter_ms, args.bandwidth_kbps, args.stall_probability, args.stall_ms)
    down_latency = args.latency_ms if args.downlink_latency_ms is None else args.downlink_latency_ms
    down = DirectionProfile(down_latency, args.jitter_ms, args.bandwidth_kbps, args.stall_probability, args.stall_ms)
    try:
        proxy = WanProxy(args.listen, args.upstream, LinkProfile(up, down, args.resets_per_minute), seed=args.seed,
                         host=args.host)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    with proxy:
        print(f"{proxy.address} -> {args.upstream}: {proxy.profile}", flush=True)
        while not done.wait(args.report_s if args.report_s > 0 else None):
            print(proxy.stats(), flush=True)
        print(proxy.stats(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
