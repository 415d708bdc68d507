"""`specdec chat`: Ctrl-C (SIGINT) stops the reply being streamed and keeps the conversation: the next message
gets its reply; a Ctrl-C at the prompt, or the end of input, quits with status 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def _start(tiny_pair) -> subprocess.Popen:
    # the tiny random models never emit EOS: a reply runs to --max-new-tokens
    return subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "chat", "--target", str(tiny_pair.target_dir), "--draft",
         str(tiny_pair.draft_dir), "--max-new-tokens", "300", "-g", "1"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=0)


@pytest.mark.slow  # > 10 s here (measured): the full suite runs it, the quick tier does not
def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(tiny_pair):
    proc = _start(tiny_pair)
    try:
        proc.stdin.write("Tell a long story.\n")
        proc.stdin.flush()
        assert proc.stdout.read(1)  # the reply is streaming
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.stdin.write("And another one.\n")
        proc.stdin.close()
        proc.stdout.read()
        err = proc.stderr.read()
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "[reply stopped" in err, err
    assert err.count("tokens,") == 1, err  # the second reply ran to its end: its statistics line
    assert "Traceback" not in err and "error:" not in err, err
