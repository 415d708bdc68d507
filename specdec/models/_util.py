"""Shared utilities of model preparation: atomic directories, completion markers, progress bars, offline mode."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specdec_runtime.common.paths import COMPLETE_MARKER, is_complete

log = logging.getLogger(__name__)


class Progress:
    """Step progress: a tqdm bar on a terminal, one plain line per step on any other stderr (a log file, a pipe:
    a bar's carriage returns would join into one long line), nothing when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool):
        import sys

        self._bar = None
        self._lines = enabled and not sys.stderr.isatty()
        self._desc, self._total, self._done = desc, total, 0
        if enabled and not self._lines:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="step", leave=True)

    def step(self, what: str) -> None:
        import sys

        log.info("%s", what)
        if self._bar is not None:
            self._bar.set_postfix_str(what, refresh=True)
        elif self._lines:
            print(f"{self._desc}: step {self._done + 1}/{self._total}: {what}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@contextlib.contextmanager
def atomic_dir(out_dir: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of ``out_dir``; on success move it to ``out_dir`` (replacing it).

    If another process completed ``out_dir`` meanwhile (and ``force`` is False), its result is kept and
    ours discarded.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".specdec-tmp-{out_dir.name}-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the final directory gets normal permissions
    try:
        yield tmp
        if is_complete(out_dir) and not force:
            log.info("%s was completed by another process; keeping it", out_dir)
            return
        if out_dir.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".specdec-tmp-old-{out_dir.name}-", dir=out_dir.parent))
            os.replace(out_dir, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_marker(directory: Path, info: dict[str, Any]) -> None:
    info = {"created_unix": time.time(), **info}
    (directory / COMPLETE_MARKER).write_text(json.dumps(info, indent=2, default=str) + "\n")


def offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def onnx_bytes(onnx_path: Path) -> int:
    """Size of an ONNX model including external data files beside it."""
    total = onnx_path.stat().st_size
    for f in onnx_path.parent.iterdir():
        if f.suffix in (".data", ".onnx_data") or f.name.endswith(".onnx.data"):
            total += f.stat().st_size
    return total
