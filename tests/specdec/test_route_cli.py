"""--route and bench --wan: a bad value is one line on stderr and a failure exit, before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("args, message", [
    (["generate", "--route", "fastest", "hi"], "--route must be one of speculative, cloud, device, auto"),
    (["chat", "--route", "fastest"], "--route must be one of"),
    (["edge-serve", "--route", "fastest"], "--route must be one of"),
    (["bench", "--wan", "10,-5"], "--wan needs numbers >= 0"),
    (["bench", "--wan", "10", "--route", "device"], "--route for --wan: speculative, cloud, auto"),
    (["bench", "--wan", "10", "--wan-repeats", "0"], "--wan-repeats must be at least 1, got 0"),
])
def test_bad_route_options_fail_in_one_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=100,
                          stdin=subprocess.DEVNULL)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and message in lines[0], proc.stderr
