"""The saved cost table: the profiled forward passes of one target on one device, kept between runs so that a
verifier starts from the last profile instead of measuring again before it serves.

One small JSON file per (target, device, dtype, torch threads, torch version), in ``<specdec cache
dir>/cost-tables/`` by default (``$SPECDEC_CACHE_DIR``, else ``~/.cache/specdec``)::

    {"version": 1, "key": {...what the file is for...}, "saved_at": <unix s>,
     "points": [[rows, tokens, seconds], ...]}

The target is named by its id, its ``config.json`` and the size of its weight files (a re-exported or re-quantised
model is another file); the time of a pass depends on all of them, and on the device, the dtype and the number of
threads. A file that is missing, unreadable, of another version or for another key is no table (the verifier
then probes once and profiles again in the background). Written atomically (a temporary file in the same
directory, then ``os.replace``): a reader sees the old table or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["CostTableCache", "default_cost_table_dir", "target_key"]

log = logging.getLogger(__name__)
_VERSION = 1


def default_cost_table_dir() -> Path:
    """``$SPECDEC_COST_TABLE_DIR``, else ``<specdec cache dir>/cost-tables`` (``$SPECDEC_CACHE_DIR`` or
    ``~/.cache/specdec``)."""
    from specdec_runtime.common.paths import default_cache_dir

    override = os.environ.get("SPECDEC_COST_TABLE_DIR")
    return Path(override).expanduser() if override else default_cache_dir() / "cost-tables"


def _weights_signature(model_dir: Path) -> list[list]:
    """[name, bytes] of the weight files of ``model_dir`` (sorted; no content read: they may be GBs)."""
    out = []
    for path in sorted(model_dir.glob("*")):
        if path.suffix in (".safetensors", ".bin", ".pt", ".gguf") and path.is_file():
            out.append([path.name, path.stat().st_size])
    return out


def target_key(runner: Any, model_id: str) -> dict:
    """What a cost table of ``runner`` (a :class:`cloud_verifier.target.runner.TargetRunner`) depends on: model
    id, a hash of its ``config.json`` and weight file sizes, device, dtype, torch intra-op threads, torch version,
    and the tensor-parallel size where it is over 1. A dict of str/int (JSON)."""
    import torch

    model_dir = Path(runner.model_dir)
    config = model_dir / "config.json"
    digest = hashlib.sha256(config.read_bytes() if config.is_file() else b"")
    digest.update(json.dumps(_weights_signature(model_dir)).encode())
    return {"model_id": str(model_id), "model": digest.hexdigest()[:16], "device": str(runner.device),
            "dtype": str(runner.dtype).replace("torch.", ""), "threads": int(torch.get_num_threads()),
            "torch": torch.__version__,
            # a tensor-parallel target (cloud_verifier.parallel) steps at another speed: its own table
            **({"tensor_parallel": runner.parallel.world_size} if getattr(runner, "parallel", None) else {})}


class CostTableCache:
    """The cost tables saved in ``directory`` (created on the first save), one file per key (:func:`target_key`).

    Points are (rows, tokens, seconds): one profiled forward pass of ``rows`` rows and ``tokens`` tokens in all
    that took ``seconds`` s."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory).expanduser() if directory is not None else default_cost_table_dir()

    def path_for(self, key: dict) -> Path:
        """The file of ``key``: a readable stem (model, device, dtype, threads) and a hash of the whole key."""
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        stem = f"{key.get('model_id', 'model')}-{key.get('device', '')}-{key.get('dtype', '')}-t{key.get('threads', '')}"
        return self.directory / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', stem)}-{digest}.json"

    def load(self, key: dict) -> list[tuple[int, int, float]] | None:
        """The points saved for ``key``, or None (no file, unreadable, another version or key, no valid point)."""
        path = self.path_for(key)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("ignoring the cost table %s: %s", path, e)
            return None
        if not isinstance(data, dict) or data.get("version") != _VERSION or data.get("key") != key:
            return None
        points = []
        for point in data.get("points") or ():
            try:
                rows, tokens, seconds = int(point[0]), int(point[1]), float(point[2])
            except (TypeError, ValueError, IndexError):
                continue
            if rows >= 1 and tokens >= rows and seconds > 0:
                points.append((rows, tokens, seconds))
        return points or None

    def save(self, key: dict, points: list[tuple[int, int, float]]) -> Path | None:
        """Write ``points`` for ``key`` atomically; the file's path, or None when it could not be written (a
        read-only cache dir is no error: the next start probes again). Logged either way."""
        path = self.path_for(key)
        body = json.dumps({"version": _VERSION, "key": key, "saved_at": round(time.time(), 3),
                           "points": [[int(r), int(t), float(s)] for r, t, s in points]}, indent=1)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cost table not saved to %s: %s", path, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return None
        log.info("cost table saved to %s (%d passes)", path, len(points))
        return path
