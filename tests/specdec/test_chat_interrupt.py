"""`specdec chat`: Ctrl-C (SIGINT) stops the reply being streamed and keeps the conversation: the next message
gets its reply; a Ctrl-C at the prompt, or the end of input, quits with status 0."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def _start(tiny_pair, server: str | None = None) -> subprocess.Popen:
    # the tiny random models never emit EOS: a reply runs to --max-new-tokens
    where = ["--server", server] if server else ["--target", str(tiny_pair.target_dir)]
    return subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "chat", *where, "--draft", str(tiny_pair.draft_dir),
         "--max-new-tokens", "300", "-g", "1"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=0,
        preexec_fn=_sigint_as_from_a_terminal)


def _sigint_as_from_a_terminal() -> None:
    """In the child: SIGINT back to its default, so Python turns it into KeyboardInterrupt. A test run started
    as a background job of a non-interactive shell ignores SIGINT, and children inherit that (Python then never
    installs its handler): the Ctrl-C would be lost, as it is for a background job, not a terminal's."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def _slow_verifier(tiny_pair):
    """A real verifier behind a 50 ms (each way) WAN: a 300-token reply takes ~150 round trips, many seconds, so
    the Ctrl-C sent once its first character is read lands inside it, however loaded the machine (on loopback
    the whole reply took ~1 s, and a Ctrl-C that came after it made the test fail)."""
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec.embedded import EmbeddedServer
    from specdec.netem import LinkProfile, WanProxy

    embedded = EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir)), grace_s=0.5)
    address = embedded.start()
    try:
        with WanProxy(0, address, LinkProfile.symmetric(latency_ms=50), seed=0) as wan:
            yield wan.address
    finally:
        embedded.stop()


@pytest.mark.slow  # > 10 s here (measured): the full suite runs it, the quick tier does not
def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(tiny_pair):
    with _slow_verifier(tiny_pair) as server:
        proc = _start(tiny_pair, server)
        _interrupt_the_first_reply(proc)
        err = proc.stderr.read()
    assert proc.returncode == 0, err
    assert "[reply stopped" in err, err
    assert err.count("tokens,") == 1, err  # the second reply ran to its end: its statistics line
    assert "Traceback" not in err and "error:" not in err, err


def _interrupt_the_first_reply(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.write("Tell a long story.\n")
        proc.stdin.flush()
        assert proc.stdout.read(1)  # the reply is streaming
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.stdin.write("And another one.\n")
        proc.stdin.close()
        proc.stdout.read()
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
