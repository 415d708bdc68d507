"""Processes on 127.0.0.1 for the chaos bench and the failure tests: free ports, bounded waits, and ending a
process by its own pid (never by name)."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return bool(pred())


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s`` (only this process, by its pid)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
