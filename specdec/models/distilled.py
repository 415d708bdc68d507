"""The distilled draft: install a distilled FR-Spec draft from a small artefact + the target's tensors.

The artefact (see ``specdec.distill``) holds only what the target does not: the draft's decoder layers, its final
norm and its head vocabulary (token ids), float16. The draft reuses the target's (tied) embedding matrix both as
input embeddings and, restricted to the head vocabulary rows, as its LM head; its ONNX export keeps the layout of
:mod:`specdec.models`, with ``logits`` full width [B, S, vocab] and DISTILLED_MASKED_LOGIT outside the head
vocabulary (q = 0 there: rejection stays exact).
"""

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

import numpy as np

from specdec_runtime.common.paths import (
    EXPORT_REPORT,
    ONNX_FILE,
    TARGET_DIR_NAME,
    ModelNotFoundError,
    default_model_paths,
    is_complete,
    resolve_target_dir,
)

from ._util import atomic_dir, offline_env, onnx_bytes, Progress, write_marker
from .gguf import prepare_target_from_gguf
from .onnx_check import FP32_TOLERANCE, ExportCheckError, check_fp32, kv_shape, ort_run, ort_session
from .onnx_export import OPSET, export_fp32
from .quantize import quantize_onnx_int8

log = logging.getLogger(__name__)

DISTILLED_DRAFT_DIR_NAME = "smollm2-135m-instruct-distilled"
DISTILLED_ARTEFACT_FORMAT = "specdec-distilled-draft/1"
DISTILLED_ARTEFACT_CONFIG = "draft_config.json"
DISTILLED_ARTEFACT_WEIGHTS = "draft_weights.safetensors"
DISTILLED_HEAD_IDS_KEY = "head_token_ids"
DISTILLED_MASKED_LOGIT = -1.0e9  # exp(-1e9 - max) == 0 exactly in float32/float64


def default_distilled_artefact_dir() -> Path:
    """The committed artefact of the default distilled draft (``<repo>/drafts/smollm2-135m-instruct``)."""
    return Path(__file__).resolve().parents[2] / "drafts" / TARGET_DIR_NAME


def _frspec_head_class() -> Any:
    import torch

    class FrSpecHead(torch.nn.Module):
        """LM head over a token subset (FR-Spec): logits of ``token_ids`` scattered into a full-width row.

        ``weight`` [N, hidden] are the target LM-head rows of ``token_ids`` [N]; every other column of the
        output [..., vocab_size] is DISTILLED_MASKED_LOGIT. ``subset_logits`` gives the [..., N] logits alone.
        """

        def __init__(self, weight: "torch.Tensor", token_ids: "torch.Tensor", vocab_size: int) -> None:
            super().__init__()
            self.register_buffer("weight", weight.detach().clone())
            self.register_buffer("token_ids", token_ids.detach().to(torch.long).clone())
            self.vocab_size = int(vocab_size)

        def subset_logits(self, hidden: "torch.Tensor") -> "torch.Tensor":
            return torch.nn.functional.linear(hidden, self.weight)

        def forward(self, hidden: "torch.Tensor") -> "torch.Tensor":
            sub = self.subset_logits(hidden)  # [B, S, N]
            idx = self.token_ids.expand(sub.shape[0], sub.shape[1], -1)
            base = torch.full_like(sub[..., :1], DISTILLED_MASKED_LOGIT).expand(-1, -1, self.vocab_size)
            return base.scatter(-1, idx, sub)

    return FrSpecHead


def make_frspec_head(embedding: Any, token_ids: Any) -> Any:
    """FrSpecHead over ``token_ids`` whose rows are taken from ``embedding`` [vocab, hidden] (tied LM head)."""
    import torch

    ids = torch.as_tensor(token_ids, dtype=torch.long)
    return _frspec_head_class()(embedding.detach()[ids], ids, embedding.shape[0])


def draft_config_from_target(target_config: Any, num_layers: int) -> Any:
    """The target's config with ``num_layers`` decoder layers (same hidden size, heads, vocab, rope)."""
    import copy

    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = int(num_layers)
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[: int(num_layers)]
    cfg.tie_word_embeddings = True
    cfg.use_cache = True
    return cfg


def build_distilled_draft(target: Any, num_layers: int, head_token_ids: Any, layer_state: dict | None = None,
                          init_layer_ids: list[int] | None = None) -> Any:
    """A LlamaForCausalLM-style draft sharing ``target``'s embedding, with an FR-Spec head.

    Args:
        target: the target HF causal LM (float32).
        num_layers: decoder layers of the draft.
        head_token_ids: the head vocabulary (token ids, any int sequence/tensor).
        layer_state: state dict of the draft's own tensors (``layers.{j}.*``, ``norm.weight``; keys as in
            ``model.*`` of the HF model, without the ``model.`` prefix); None = initialise the layers from the
            target's layers ``init_layer_ids`` (default: spread evenly over its depth, first and last included)
            and the norm from the target's final norm.

    Returns:
        The draft (eval mode, float32); the embedding is the target's Parameter itself (shared, frozen).
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = draft_config_from_target(target.config, num_layers)
    with _no_init_weights():
        draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight
    draft.model.embed_tokens.weight.requires_grad_(False)
    if layer_state is None:
        n_target = target.config.num_hidden_layers
        if init_layer_ids is None:
            init_layer_ids = spread_layer_ids(n_target, num_layers)
        for j, li in enumerate(init_layer_ids):
            draft.model.layers[j].load_state_dict(target.model.layers[li].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    else:
        own = {k: v.to(torch.float32) for k, v in layer_state.items()}
        missing, unexpected = draft.model.load_state_dict(own, strict=False)
        missing = [k for k in missing if not k.startswith("embed_tokens.") and "rotary_emb" not in k]
        if missing or unexpected:
            raise ValueError(f"distilled draft weights do not fit: missing {missing}, unexpected {unexpected}")
    draft.lm_head = make_frspec_head(target.model.embed_tokens.weight, head_token_ids)
    draft.config.specdec_head_vocab = int(len(draft.lm_head.token_ids))
    return draft.eval()


def spread_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """``num_layers`` layer indices spread evenly over ``range(num_target_layers)``, first and last included."""
    if num_layers <= 1:
        return [0][:num_layers]
    return [int(round(x)) for x in np.linspace(0, num_target_layers - 1, num_layers)]


def draft_own_state(draft: Any) -> dict[str, Any]:
    """The draft-specific tensors (decoder layers, final norm) of a distilled draft, keyed as in ``draft.model``."""
    return {
        k: v.detach()
        for k, v in draft.model.state_dict().items()
        if not k.startswith("embed_tokens.") and "rotary_emb" not in k
    }


@contextlib.contextmanager
def _no_init_weights() -> Iterator[None]:
    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:  # pragma: no cover
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            no_init_weights = contextlib.nullcontext
    with no_init_weights():
        yield


def target_fingerprint(target: Any) -> str:
    """sha256 of the target's embedding matrix (float32 bytes): the artefact fits only this target."""
    import hashlib

    w = target.model.embed_tokens.weight.detach().to("cpu").float().contiguous().numpy()
    return hashlib.sha256(w.tobytes()).hexdigest()


def save_distilled_artefact(draft: Any, target: Any, out_dir: str | os.PathLike, extra: dict | None = None) -> Path:
    """Write the committed artefact of ``draft``: its own tensors (float16) + head ids + config JSON.

    Returns:
        ``out_dir``. Total size ~7 MB per layer (SmolLM2-135M geometry) plus 4 bytes per head id.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.float16).contiguous() for k, v in draft_own_state(draft).items()}
    tensors[DISTILLED_HEAD_IDS_KEY] = draft.lm_head.token_ids.to(torch.int32).contiguous()
    save_file(tensors, str(out / DISTILLED_ARTEFACT_WEIGHTS))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out / DISTILLED_ARTEFACT_WEIGHTS, 0o666 & ~umask)  # safetensors may leave it 0600
    tc = target.config
    cfg = {
        "format": DISTILLED_ARTEFACT_FORMAT,
        "num_layers": int(draft.config.num_hidden_layers),
        "head_vocab": int(len(draft.lm_head.token_ids)),
        "dtype": "float16",
        "target": {
            "model_type": tc.model_type,
            "hidden_size": tc.hidden_size,
            "vocab_size": tc.vocab_size,
            "num_hidden_layers": tc.num_hidden_layers,
            "embedding_sha256": target_fingerprint(target),
        },
        **(extra or {}),
    }
    (out / DISTILLED_ARTEFACT_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def load_distilled_draft(target: Any, artefact_dir: str | os.PathLike, check_fingerprint: bool = True) -> Any:
    """Rebuild the full draft from ``target`` (embedding, LM-head rows) and the artefact in ``artefact_dir``.

    Raises:
        ModelNotFoundError: no artefact there.
        ValueError: the artefact was made for another target (geometry or embedding fingerprint differ).
    """
    from safetensors.torch import load_file

    a = Path(artefact_dir)
    if not (a / DISTILLED_ARTEFACT_CONFIG).is_file() or not (a / DISTILLED_ARTEFACT_WEIGHTS).is_file():
        raise ModelNotFoundError(f"no distilled draft artefact at {a}")
    cfg = json.loads((a / DISTILLED_ARTEFACT_CONFIG).read_text())
    if cfg.get("format") != DISTILLED_ARTEFACT_FORMAT:
        raise ValueError(f"{a}: unknown artefact format {cfg.get('format')!r}")
    tc, want = target.config, cfg["target"]
    for key in ("hidden_size", "vocab_size"):
        if getattr(tc, key) != want[key]:
            raise ValueError(f"{a}: draft made for a target with {key}={want[key]}, this one has {getattr(tc, key)}")
    if check_fingerprint and want.get("embedding_sha256") and target_fingerprint(target) != want["embedding_sha256"]:
        raise ValueError(f"{a}: draft made for another target (embedding fingerprint differs)")
    tensors = load_file(str(a / DISTILLED_ARTEFACT_WEIGHTS))
    head_ids = tensors.pop(DISTILLED_HEAD_IDS_KEY)
    return build_distilled_draft(target, cfg["num_layers"], head_ids, layer_state=tensors)


def export_distilled_onnx(
    draft: Any,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    quantize_int8: bool = False,
    int8_method: str = "matmul_nbits",
    check: bool = True,
    force: bool = True,
    extra_report: dict | None = None,
) -> Path:
    """Export a distilled draft (FR-Spec head) to an ONNX draft directory in the layout of this module.

    Same checks as :func:`export_onnx_draft` (fp32 ONNX vs PyTorch at several (past, seq) shapes, left
    padding) plus: logits outside the head vocabulary are DISTILLED_MASKED_LOGIT.

    Raises:
        ExportCheckError: the ONNX logits differ from PyTorch's by more than FP32_TOLERANCE.
    """
    import onnx

    out = Path(out_dir).expanduser()
    if is_complete(out) and not force:
        return out
    report: dict[str, Any] = {
        "kind": "distilled-frspec",
        "opset": OPSET,
        "num_layers": draft.config.num_hidden_layers,
        "vocab_size": draft.config.vocab_size,
        "head_vocab": int(len(draft.lm_head.token_ids)),
        "quantized_int8": quantize_int8,
        **(extra_report or {}),
    }
    t0 = time.perf_counter()
    draft = draft.eval()
    with atomic_dir(out, force=True) as tmp:
        fp32_dir = Path(tempfile.mkdtemp(prefix="fp32-", dir=tmp)) if quantize_int8 else tmp
        fp32_path = fp32_dir / ONNX_FILE
        export_fp32(draft, fp32_path)
        onnx.checker.check_model(str(fp32_path))
        report["fp32_bytes"] = onnx_bytes(fp32_path)
        if check:
            sess = ort_session(fp32_path)
            res = check_fp32(sess, draft, tokenizer)
            logits, _ = ort_run(sess, np.arange(3, dtype=np.int64)[None] + 1, None, draft.config.num_hidden_layers,
                                 kv_shape(draft.config))
            outside = np.ones(draft.config.vocab_size, bool)
            outside[draft.lm_head.token_ids.numpy()] = False
            res["outside_head_max_logit"] = float(logits[0][:, outside].max()) if outside.any() else None
            report["fp32_check"] = res
            if not res["max_abs_diff"] <= FP32_TOLERANCE or (
                outside.any() and res["outside_head_max_logit"] > DISTILLED_MASKED_LOGIT / 2
            ):
                raise ExportCheckError(f"ONNX export of the distilled draft is wrong: {res}")
        if quantize_int8:
            report["int8"] = quantize_onnx_int8(fp32_path, tmp / ONNX_FILE, int8_method)
            shutil.rmtree(fp32_dir, ignore_errors=True)
        report["model_bytes"] = onnx_bytes(tmp / ONNX_FILE)
        draft.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        report["total_s"] = round(time.perf_counter() - t0, 2)
        (tmp / EXPORT_REPORT).write_text(json.dumps(report, indent=2) + "\n")
        write_marker(tmp, {"kind": "onnx-draft-distilled", "quantized_int8": quantize_int8})
    return out


def install_distilled_draft(
    target_dir: str | os.PathLike,
    artefact_dir: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    *,
    quantize_int8: bool = False,
    check: bool = True,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Rebuild a distilled draft from the target + its artefact and export it as an ONNX draft directory.

    Args:
        target_dir: the target HF directory (its embedding gives the draft's embedding and LM-head rows).
        artefact_dir: the committed artefact (``draft_config.json`` + ``draft_weights.safetensors``); None =
            :func:`default_distilled_artefact_dir`.
        out_dir: the ONNX draft directory to write (atomically; skipped when complete unless ``force``).
        quantize_int8: int8 MatMulNBits weights (smaller/faster, slightly lower agreement).

    Returns:
        ``out_dir`` as a Path (~10 s on 2 CPU cores).

    Raises:
        ModelNotFoundError: no target or no artefact. ValueError: artefact for another target.
        ExportCheckError: the ONNX export does not reproduce PyTorch.
    """
    out = Path(out_dir).expanduser()
    if is_complete(out) and not force:
        log.info("distilled draft already installed at %s", out)
        return out
    src = resolve_target_dir(target_dir)
    art = Path(artefact_dir) if artefact_dir is not None else default_distilled_artefact_dir()
    offline_env()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bar = Progress(2, f"distilled draft {out.name}", progress)
    try:
        bar.step("rebuilding the draft from the target + artefact")
        target = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, attn_implementation="eager")
        draft = load_distilled_draft(target, art)
        draft.config._attn_implementation = "eager"
        tokenizer = AutoTokenizer.from_pretrained(str(src))
        bar.advance()
        bar.step("exporting ONNX")
        export_distilled_onnx(draft, tokenizer, out, quantize_int8=quantize_int8, check=check, force=True,
                              extra_report={"source": str(src), "artefact": str(art)})
        bar.advance()
    finally:
        bar.close()
    return out


def prepare_distilled_draft(
    cache_dir: str | os.PathLike | None = None,
    artefact_dir: str | os.PathLike | None = None,
    force: bool = False,
    progress: bool = True,
    quantize_int8: bool = True,
) -> Path:
    """Install the committed distilled draft of the default target at ``<cache>/smollm2-135m-instruct-distilled``.

    Prepares the target first when needed (:func:`prepare_target_from_gguf`). ``quantize_int8`` (default):
    MatMulNBits int8 weights, measured on SmolLM2-135M at the same held-out greedy agreement as fp32
    (0.345 vs 0.349) for ~0.6x the draft time. Takes ~1-2 min on 2 busy CPU cores (export + checks).
    """
    paths = default_model_paths(cache_dir)
    prepare_target_from_gguf(paths.target_dir, progress=progress, force=False)
    return install_distilled_draft(paths.target_dir, artefact_dir, paths.target_dir.parent / DISTILLED_DRAFT_DIR_NAME,
                                   quantize_int8=quantize_int8, force=force, progress=progress)
