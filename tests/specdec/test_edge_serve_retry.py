"""`specdec edge-serve --retry-max-attempts N --retry-budget-s S`: the flags are the endpoint's failover retry
policy. A real edge-serve subprocess (tiny pair) in front of an address nothing listens on: every attempt fails
at once (connection refused), so the 503's message says how many attempts the policy allowed and for how long
(``gave up after N attempts in T s``, edge_client.transport.retry.exhausted_error). Out-of-range values are one error line.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
from test_openai_server import _edge_serve  # noqa: E402 - the subprocess fixture of the endpoint's main test

pytestmark = pytest.mark.timeout(600)


def _down_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def _gave_up(url: str) -> tuple[int, float, float]:
    """(attempts, seconds the policy says it retried, seconds the request took) of a request that gets 503."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}],
                                  max_tokens=4, temperature=0)
    took = time.monotonic() - t0
    assert e.value.status_code == 503, e.value
    m = re.search(r"gave up after (\d+) attempts in ([0-9.]+) s", str(e.value))
    assert m, str(e.value)
    return int(m.group(1)), float(m.group(2)), took


def test_retry_flags_reach_the_failover_policy(tiny_pair):
    down = _down_address()
    models = ("--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir))
    with _edge_serve("--server", down, *models, "--retry-max-attempts", "3", "--retry-budget-s", "600") as url:
        attempts, _, _ = _gave_up(url)
    assert attempts == 3  # the default policy makes 8
    with _edge_serve("--server", down, *models, "--retry-max-attempts", "100000", "--retry-budget-s", "3") as url:
        attempts, retried_s, took = _gave_up(url)
    # the budget ends it: the policy reports at least the 3 s budget retried, and under the default budget (30 s)
    # it would report 30 s or more (no bound tighter than that: the machine may be loaded)
    assert 3.0 <= retried_s < 30.0, (retried_s, took)
    assert attempts > 3


@pytest.mark.parametrize("flag, value, expected", [("--retry-max-attempts", "0", "max_attempts must be >= 1"),
                                                   ("--retry-budget-s", "-1", "budget_s must be >= 0")])
def test_retry_flags_out_of_range(flag, value, expected):
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "edge-serve", "--server", "127.0.0.1:1", flag, value],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"error: {flag}") and expected in lines[0], lines[0]
