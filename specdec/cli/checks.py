"""Argument checks every command runs before it loads anything (torch, a model, a port): each failure is one
``error: ...`` line and exit status 2, within a fraction of a second."""

from __future__ import annotations

import re
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from specdec.cli._shared import _fail

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_server(server: str | None) -> list[str] | None:
    """The addresses of ``--server`` (None without it), or exit: empty, a URL, no port, a port out of range."""
    if server is None:
        return None
    from common.errors import InvalidRequestError
    from edge_client.connections import parse_addresses

    try:
        return parse_addresses(server)
    except InvalidRequestError as e:
        _fail(f"--server: {e}")


def check_device_names(device: str, dtype: str) -> None:
    """Exit on a device or dtype name no torch would accept (the CUDA check itself needs torch: later)."""
    if not _DEVICE_RE.match(str(device).strip().lower()):
        _fail(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N")
    if str(dtype).strip().lower() not in _DTYPES:
        _fail(f"unknown dtype {dtype!r}: use {', '.join(_DTYPES)}")


def check_model_dirs(target: Path | None, draft: Path | None) -> None:
    """Exit when ``--target`` is not an HF model directory or ``--draft`` holds no ONNX draft (given ones only)."""
    from common.paths import ModelNotFoundError, resolve_draft_dir, resolve_target_dir

    try:
        if target is not None:
            resolve_target_dir(target)
        if draft is not None:
            resolve_draft_dir(draft)
    except (ModelNotFoundError, ValueError) as e:
        _fail(str(e))


def check_readable(path, flag: str) -> None:
    """Exit unless ``path`` (when given) is a file this process can read."""
    if path is None or str(path) == "":
        return
    p = Path(path)
    if not p.is_file():
        _fail(f"{flag} {p}: no such file")
    try:
        with p.open("rb"):
            pass
    except OSError as e:
        _fail(f"{flag} {p}: cannot read it ({e.strerror})")


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Exit when ``host:port`` cannot be bound now: in use, or an address of no interface here (port 0 = any)."""
    if not 0 <= port <= 65535:
        _fail(f"{flag} must be in [0, 65535], got {port}")
    if port == 0:
        return
    bind_host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no obstacle to the server
            s.bind((bind_host, port))
    except OSError as e:
        if e.errno == 98:  # EADDRINUSE
            _fail(f"{flag} {port}: the port is in use on {host} (another server runs there: stop it or choose "
                  "another port)")
        _fail(f"cannot listen on {host}:{port}: {e.strerror or e}")


def start_preflight(addresses: list[str], security, *, unreachable_is_error: bool) -> Future:
    """A background probe of the verifier addresses (:func:`edge_client.probe.diagnose`) while models load:
    its result is the one-line reason none can serve, or None."""
    from edge_client.probe import diagnose

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-preflight")
    future = pool.submit(diagnose, addresses, security, 2.0, unreachable_is_error=unreachable_is_error)
    pool.shutdown(wait=False)
    return future
