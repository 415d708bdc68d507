"""ONNX export of a draft with KV cache (text-generation-with-past layout, see :mod:`specdec.models`): the fp32
graph, its checks (:mod:`.onnx_check`: fp32 ONNX logits vs PyTorch at several (past, seq) shapes, int8 top-1 /
greedy agreement), int8 quantization, the draft directory.

Two graph builders: ONNX Runtime GenAI's model builder (fused GroupQueryAttention graph, run as a subprocess) and
``torch.onnx.export`` of a flat-signature wrapper (see :func:`export_onnx_draft`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from specdec_runtime.common.paths import EXPORT_REPORT, ONNX_FILE, is_complete, resolve_target_dir

from ._util import atomic_dir, offline_env, onnx_bytes, Progress, write_marker
from .onnx_check import ExportCheckError  # noqa: F401 - raised by export_onnx_draft (through the check)
from .onnx_check import check_fp32_or_raise, check_int8, io_names, kv_shape
from .quantize import INT8_METHODS, fold_initializer_transposes, quantize_onnx_int8
from .windows import genai_input_dir, layer_windows

log = logging.getLogger(__name__)

OPSET = 17
DRAFT_BUILDERS = ("auto", "genai", "torch")  # how export_onnx_draft builds the ONNX graph (see there)


class DraftBuildError(RuntimeError):
    """ONNX Runtime GenAI's model builder failed or is not installed (message has the builder's last lines)."""


def _onnx_wrapper(model: Any) -> Any:
    """A torch.nn.Module around an HF causal LM with the flat (optimum-style) ONNX signature."""
    import torch
    from transformers import DynamicCache

    num_layers = model.config.num_hidden_layers
    windows = layer_windows(model.config)
    window = next((w for w in windows if w), None)
    mixed = window is not None and None in windows

    class OnnxCausalLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):  # noqa: ANN001
            seq = input_ids.shape[1]
            kv_len = attention_mask.shape[1]
            # Explicit 4D additive mask (batch, 1, seq, past+seq): causal over cache slots AND the 2D padding
            # mask. Handing HF a ready 4D mask bypasses its mask builder, whose Python branches (q_length == 1,
            # "no padding" skips for sdpa) would otherwise be frozen into the trace.
            kv_idx = torch.arange(kv_len, device=input_ids.device)
            q_idx = kv_idx[kv_len - seq :]
            causal = kv_idx[None, :] <= q_idx[:, None]
            padding = attention_mask[:, None, None, :] > 0
            mask = _additive(causal[None, None] & padding, self.model.dtype)
            if window:  # sliding-window layers: keys i - window < j <= i, HF's convention
                local = _additive((causal & (kv_idx[None, :] > q_idx[:, None] - window))[None, None] & padding,
                                  self.model.dtype)
                # mixed layers take HF's per-layer-type mapping; uniform windows (Mistral, Phi-3) one mask
                mask = {"full_attention": mask, "sliding_attention": local} if mixed else local
            # full-length layers for windowed models too (a config would make sliding layers keep only the
            # window; the runner's layout has every present.{i} past + new tokens long, the mask applies the window)
            cache = DynamicCache(
                [(past[2 * i], past[2 * i + 1]) for i in range(num_layers)],
                config=None if window else self.model.config,
            )
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            present = []
            for layer in cache.layers:
                present.extend((layer.keys, layer.values))
            return (out.logits, *present)

    return OnnxCausalLM().eval()


def _additive(allowed: Any, dtype: Any) -> Any:
    """An additive attention mask: 0 where ``allowed`` (bool), the dtype's minimum elsewhere."""
    import torch

    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def export_fp32(model: Any, onnx_path: Path) -> None:
    import torch

    cfg = model.config
    num_layers = cfg.num_hidden_layers
    kv_heads, head_dim = kv_shape(cfg)
    in_names, out_names = io_names(num_layers)
    # Trace with batch 2, seq 3 > 1 and past 4 > 0 so no size is 0 or 1 (no specialisation on them).
    batch, seq, past_len = 2, 3, 4
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, past_len + seq, dtype=torch.int64)
    position_ids = torch.arange(past_len, past_len + seq).repeat(batch, 1)
    past = [torch.randn(batch, kv_heads, past_len, head_dim, generator=g) for _ in range(2 * num_layers)]
    dynamic_axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch_size", 1: "sequence_length"},
        "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
        "position_ids": {0: "batch_size", 1: "sequence_length"},
        "logits": {0: "batch_size", 1: "sequence_length"},
    }
    for n in in_names[3:]:
        dynamic_axes[n] = {0: "batch_size", 2: "past_sequence_length"}
    for n in out_names[1:]:
        dynamic_axes[n] = {0: "batch_size", 2: "total_sequence_length"}
    wrapper = _onnx_wrapper(model)
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings about Python-constant shapes are expected
        torch.onnx.export(
            wrapper,
            (input_ids, attention_mask, position_ids, *past),
            str(onnx_path),
            input_names=in_names,
            output_names=out_names,
            dynamic_axes=dynamic_axes,
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )


def genai_builder_available() -> bool:
    """Whether ONNX Runtime GenAI's model builder (``onnxruntime_genai.models.builder``) is importable."""
    try:
        return importlib.util.find_spec("onnxruntime_genai.models.builder") is not None
    except (ImportError, ValueError):
        return False


def _export_fp32_genai(hf_dir: Path, out_dir: Path, timeout_s: float = 1800.0) -> Path:
    """Build the fp32 ONNX model of ``hf_dir`` into ``out_dir`` with ONNX Runtime GenAI's model builder.

    The builder (``python -m onnxruntime_genai.models.builder -p fp32 -e cpu``, run as a subprocess: it logs
    every node) emits the same I/O names as the torch export minus ``position_ids`` (GroupQueryAttention derives
    positions from ``attention_mask``), with fused ops: packed QKV MatMul, GroupQueryAttention (rotary inside,
    KV concatenated inside), SkipSimplifiedLayerNormalization. Its own tokenizer / genai_config files are removed
    (the caller writes the HF config and tokenizer).

    Returns:
        The path of ``model.onnx`` (weights in ``model.onnx.data`` beside it).

    Raises:
        DraftBuildError: the builder is not installed, fails, or times out (the message has its last lines).
    """
    if not genai_builder_available():
        raise DraftBuildError("onnxruntime-genai is not installed (pip install --no-deps onnxruntime-genai)")
    from transformers import AutoConfig

    cache = Path(tempfile.mkdtemp(prefix="builder-cache-", dir=out_dir.parent))
    src = genai_input_dir(hf_dir, AutoConfig.from_pretrained(hf_dir), cache)
    # windowed_kv_cache=false: sliding-window layers keep a full-length KV cache like the others (the runner's
    # layout: every present.{i} is past + new tokens long); the window is applied by local_window_size
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out_dir),
           "-p", "fp32", "-e", "cpu", "-c", str(cache), "--extra_options", "windowed_kv_cache=false"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DraftBuildError(f"onnxruntime-genai model builder timed out after {timeout_s:.0f} s") from exc
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    model_path = out_dir / ONNX_FILE
    if proc.returncode != 0 or not model_path.is_file():
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        raise DraftBuildError(f"onnxruntime-genai model builder failed (exit {proc.returncode}): {tail}")
    for f in out_dir.iterdir():
        if f.is_file() and f.name not in (ONNX_FILE, ONNX_FILE + ".data"):
            f.unlink()
    return model_path


def _refuse_recurrent(src: Path) -> None:
    """Raises ValueError (one line) for a model with conv / SSM / linear-attention layers: the draft runner's
    ONNX graph carries KV caches only, no recurrent state (a hybrid can be the target, not the draft)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src)
    types = sorted({t for t in (getattr(config, "layer_types", None) or [])
                    if t in ("conv", "linear_attention", "mamba", "hybrid")})
    if types:
        raise ValueError(f"draft export: {getattr(config, 'model_type', '?')} has layers of type {', '.join(types)} "
                         "with a recurrent state the ONNX draft cannot carry; use an attention-only draft "
                         "(a hybrid model can be the target)")


def export_onnx_draft(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    quantize_int8: bool = True,
    progress: bool = True,
    check: bool = True,
    force: bool = False,
    int8_method: str = "matmul_nbits",
    builder: str = "auto",
) -> Path:
    """Export an HF causal LM with KV cache to ONNX (text-generation-with-past layout), optionally int8.

    Two graph builders (``builder``):

    - ``"genai"``: ONNX Runtime GenAI's model builder (``onnxruntime-genai``, run offline on the local
      directory) in fp32: fused GroupQueryAttention (rotary inside), packed QKV, SkipSimplifiedLayerNorm; no
      ``position_ids`` input. For SmolLM2-135M: ~340 nodes instead of ~2,900, one-token forward 10.6 vs 14.7 ms
      on one core at the same greedy agreement (int8).
    - ``"torch"``: ``torch.onnx.export(dynamo=False)`` traced with batch 2, seq 3, past 4 and dynamic batch /
      sequence / past axes; the causal + padding mask is built inside the graph.
    - ``"auto"`` (default): genai when installed and it succeeds for this architecture, else torch.

    Either result is valid for seq = 1 and seq > 1, with and without past (verified when ``check``); int8
    quantization (MatMulNBits) is the same for both.

    Args:
        hf_dir: HF causal-LM directory (see :func:`resolve_target_dir`).
        out_dir: destination (written atomically; skipped when already complete). Receives ``model.onnx``,
            ``config.json``, the tokenizer files and ``specdec_export.json`` (check numbers).
        quantize_int8: int8-quantize the MatMul weights (see ``int8_method``).
        progress: show a progress bar.
        check: compare ONNX fp32 logits with PyTorch (max abs diff <= 1e-3 at several (past, seq) shapes,
            seq 1 included) and, when quantizing, record the int8 model's top-1 agreement on a short text.
        force: rebuild even if ``out_dir`` is complete.
        int8_method: ``"matmul_nbits"`` (weight-only int8 blocks, int8 compute; default, near-fp32 top-1
            agreement) or ``"dynamic"`` (``onnxruntime.quantization.quantize_dynamic``, QInt8).
        builder: ``"auto"``, ``"genai"`` or ``"torch"`` (see above). The one used is recorded in
            ``specdec_export.json`` and the completion marker.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: unknown ``int8_method`` or ``builder``; a model with recurrent (conv / SSM /
            linear-attention) layers.
        DraftBuildError: ``builder="genai"`` and the GenAI builder is missing or fails.
        ModelNotFoundError: ``hf_dir`` is not an HF causal-LM directory.
        ExportCheckError: the fp32 ONNX logits differ from PyTorch's by more than 1e-3.
    """
    if quantize_int8 and int8_method not in INT8_METHODS:
        raise ValueError(f"int8_method must be one of {INT8_METHODS}, got {int8_method!r}")
    if builder not in DRAFT_BUILDERS:
        raise ValueError(f"builder must be one of {DRAFT_BUILDERS}, got {builder!r}")
    out = Path(out_dir).expanduser()
    if is_complete(out) and not force:
        log.info("ONNX draft already exported at %s", out)
        return out
    src = resolve_target_dir(hf_dir)
    _refuse_recurrent(src)
    offline_env()
    steps = 2 + int(check) + int(quantize_int8) * (1 + int(check)) + 1
    bar = Progress(steps, f"ONNX draft {out.name}", progress)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"source": str(src), "opset": OPSET, "quantized_int8": quantize_int8}
    try:
        with atomic_dir(out, force) as tmp:
            _export_steps(tmp, src, bar, report, t0, quantize_int8=quantize_int8, check=check,
                          int8_method=int8_method, builder=builder)
    finally:
        bar.close()
    log.info("ONNX draft exported to %s in %.1f s", out, time.perf_counter() - t0)
    return out


def _export_steps(
    tmp: Path,
    src: Path,
    bar: Progress,
    report: dict[str, Any],
    t0: float,
    *,
    quantize_int8: bool,
    check: bool,
    int8_method: str,
    builder: str,
) -> None:
    """The steps of :func:`export_onnx_draft` in its temporary directory ``tmp``, numbers recorded in ``report``:
    load, build the fp32 graph, check it, quantize, check int8 agreement, save config / tokenizer / marker."""
    bar.step("loading PyTorch model")
    model, tokenizer = _load_source_model(src, report)
    bar.advance()

    bar.step("exporting ONNX (fp32)")
    fp32_dir = Path(tempfile.mkdtemp(prefix="fp32-", dir=tmp)) if quantize_int8 else tmp
    used = _build_fp32_graph(src, model, fp32_dir, builder, report)
    bar.advance()

    if check:
        bar.step("checking fp32 ONNX vs PyTorch")
        used = _check_or_fall_back(src, model, tokenizer, fp32_dir, used, builder, report)
        bar.advance()

    if quantize_int8:
        bar.step(f"quantizing int8 ({int8_method})")
        _quantize_fp32_dir(fp32_dir, tmp / ONNX_FILE, used, int8_method, report)
        bar.advance()
        if check:
            bar.step("checking int8 top-1 agreement")
            report["int8_check"] = check_int8(tmp / ONNX_FILE, model, tokenizer)
            bar.advance()
    report["model_bytes"] = onnx_bytes(tmp / ONNX_FILE)

    bar.step("saving config and tokenizer")
    _save_draft_files(tmp, src, model, tokenizer, report, t0)
    bar.advance()


def _check_or_fall_back(
    src: Path, model: Any, tokenizer: Any, fp32_dir: Path, used: str, builder: str, report: dict[str, Any]
) -> str:
    """Check the fp32 graph; with ``builder="auto"``, a GenAI graph that fails the check (an architecture detail
    the builder gets wrong, or a geometry its kernels refuse) is replaced by a torch.onnx one, checked in turn.
    Returns the builder of the graph that passed.

    Raises:
        ExportCheckError: the graph kept fails the check.
    """
    try:
        check_fp32_or_raise(src, fp32_dir / ONNX_FILE, model, tokenizer, report)
        return used
    except ExportCheckError as exc:
        if used != "genai" or builder != "auto":
            raise
        log.warning("GenAI builder graph failed its check (%s); exporting with torch.onnx", exc)
        report["genai_check_error"] = str(exc)[:500]
        report["genai_builder_failed"] = True  # re-trying on every prepare would fail again
    _clear_dir(fp32_dir)
    used = _build_fp32_graph(src, model, fp32_dir, "torch", report)
    check_fp32_or_raise(src, fp32_dir / ONNX_FILE, model, tokenizer, report)
    return used


def _clear_dir(path: Path) -> None:
    """Remove everything inside ``path`` (kept itself)."""
    for leftover in path.iterdir():
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()


def _load_source_model(src: Path, report: dict[str, Any]) -> tuple[Any, Any]:
    """The PyTorch model of ``src`` (float32, eager attention, eval mode) and its tokenizer; records its geometry."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    report["num_layers"] = model.config.num_hidden_layers
    report["vocab_size"] = model.config.vocab_size
    return model, tokenizer


def _build_fp32_graph(src: Path, model: Any, fp32_dir: Path, builder: str, report: dict[str, Any]) -> str:
    """Write the fp32 ``model.onnx`` of ``src`` into ``fp32_dir`` with the GenAI builder when ``builder`` allows
    it and it succeeds, else with torch.onnx; returns the builder used ("genai" or "torch")."""
    import onnx

    t = time.perf_counter()
    used = None
    if builder in ("auto", "genai"):
        used = _try_genai_builder(src, fp32_dir, builder, report)
    if used is None:
        fp32_path = fp32_dir / ONNX_FILE
        export_fp32(model, fp32_path)
        onnx.checker.check_model(str(fp32_path))
        used = "torch"
    report["builder"] = used
    report["export_s"] = round(time.perf_counter() - t, 2)
    report["fp32_bytes"] = onnx_bytes(fp32_dir / ONNX_FILE)
    return used


def _try_genai_builder(src: Path, fp32_dir: Path, builder: str, report: dict[str, Any]) -> str | None:
    """The builder used ("genai") when the GenAI builder made the graph; None when it is missing or failed and
    ``builder`` is "auto" (the reason is recorded, whatever it wrote removed).

    Raises:
        DraftBuildError: ``builder="genai"`` and the builder is missing or failed.
    """
    try:
        _export_fp32_genai(src, fp32_dir)
        return "genai"
    except DraftBuildError as exc:
        if builder == "genai":
            raise
        log.warning("GenAI model builder not used (%s); exporting with torch.onnx", exc)
        report["genai_builder_error"] = str(exc)
        # installed but failed for this model: re-trying on every prepare would fail again
        report["genai_builder_failed"] = genai_builder_available()
        _clear_dir(fp32_dir)  # whatever the failed builder wrote
        return None


def _quantize_fp32_dir(fp32_dir: Path, dst: Path, used: str, int8_method: str, report: dict[str, Any]) -> None:
    """Int8-quantize ``fp32_dir/model.onnx`` into ``dst`` (one file), then delete ``fp32_dir``.

    A GenAI graph's ``Transpose(initializer)`` nodes (its tied LM head) are folded first so MatMulNBits quantizes
    the LM head too.
    """
    import onnx

    t = time.perf_counter()
    fp32_path = fp32_dir / ONNX_FILE
    loaded = None
    if used == "genai" and int8_method == "matmul_nbits":
        loaded = onnx.load(str(fp32_path))
        report["folded_transposes"] = fold_initializer_transposes(loaded)
    report["int8"] = quantize_onnx_int8(fp32_path, dst, int8_method, model=loaded)
    del loaded
    shutil.rmtree(fp32_dir, ignore_errors=True)
    report["quantize_s"] = round(time.perf_counter() - t, 2)


def _save_draft_files(tmp: Path, src: Path, model: Any, tokenizer: Any, report: dict[str, Any], t0: float) -> None:
    """config.json, the tokenizer files, ``specdec_export.json`` and, last, the completion marker."""
    model.config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    report["total_s"] = round(time.perf_counter() - t0, 2)
    (tmp / EXPORT_REPORT).write_text(json.dumps(report, indent=2) + "\n")
    write_marker(tmp, {"kind": "onnx-draft", "source": str(src), "quantized_int8": report["quantized_int8"],
                        "builder": report["builder"], "int8": report.get("int8"),
                        "genai_builder_failed": report.get("genai_builder_failed", False)})
