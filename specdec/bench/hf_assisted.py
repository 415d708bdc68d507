"""HF transformers assisted generation for :func:`specdec.bench.run_bench`: the PyTorch form of the ONNX draft
(optionally int8), the HF target with SDPA attention, and one greedy ``target.generate(assistant_model=...)``."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

from ._shared import VariantSample


def draft_pytorch_source(draft_dir: Path) -> tuple[Path | None, bool, str]:
    """Where the PyTorch form of an ONNX draft is: ``(hf_dir or None, int8: bool, how it was found)``.

    The ONNX draft directory records the HF directory it was exported from (``source`` in
    ``specdec_export.json`` / the completion marker, see :func:`specdec.models.export_onnx_draft`) and whether it
    was int8-quantized. None when nothing usable is recorded.
    """
    from specdec.models import COMPLETE_MARKER, EXPORT_REPORT, resolve_target_dir

    for name in (EXPORT_REPORT, COMPLETE_MARKER):
        try:
            info = json.loads((draft_dir / name).read_text())
        except (OSError, ValueError):
            continue
        for key in ("hf_dir", "source_hf_dir", "source"):
            src = info.get(key) if isinstance(info, dict) else None
            if not src:
                continue
            try:
                hf_dir = resolve_target_dir(src)
            except Exception:  # noqa: BLE001 - recorded dir gone or not an HF dir
                continue
            return hf_dir, bool(info.get("quantized_int8", False)), f"{name}:{key}"
    return None, False, "nothing recorded"


HF_DRAFT_MODES = ("dynamic_int8", "weight_int8", "fp32")


def _fake_quantize_blockwise_(model, block_size: int = 32, bits: int = 8) -> int:
    """Round every Linear weight to symmetric ``bits``-bit integers per block of ``block_size`` input columns,
    kept in float32 (weight-only emulation of ONNX Runtime's MatMulNBits). Unties a tied lm_head first so the
    input embeddings stay exact (the ONNX graph also quantizes only the lm_head MatMul). Returns Linears done."""
    import torch
    import torch.nn.functional as F

    qmax = 2 ** (bits - 1) - 1
    out_emb = model.get_output_embeddings()
    in_emb = model.get_input_embeddings()
    if out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
        out_emb.weight = torch.nn.Parameter(out_emb.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
    n = 0
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight
                rows, cols = w.shape
                pad = (-cols) % block_size
                wb = F.pad(w, (0, pad)).view(rows, -1, block_size)
                scale = (wb.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-12)
                wq = (torch.clamp(torch.round(wb / scale), -qmax - 1, qmax) * scale).view(rows, -1)[:, :cols]
                w.copy_(wq)
                n += 1
    return n


def load_hf_models(
    target_dir: Path, draft_dir: Path, gamma: int, notes: list[str], hf_draft: str = "dynamic_int8"
) -> tuple[Any, Any, str]:
    """(HF target with SDPA attention, PyTorch draft or None, description of the draft).

    ``hf_draft`` (used when the ONNX draft is int8): "dynamic_int8" = torch.ao dynamic int8 quantization of
    every Linear (real int8 kernels); "weight_int8" = float32 weights rounded to int8 per block like the ONNX
    draft's MatMulNBits (same weights as the ONNX draft, float32 speed); "fp32" = the unquantized source.
    """
    hf_target = _load_sdpa(target_dir)
    src, int8, found = draft_pytorch_source(draft_dir)
    if src is None:
        notes.append(
            f"hf_assisted skipped: the draft {draft_dir} records no HF source directory (specdec_export.json "
            "'source'), so its PyTorch form is unknown"
        )
        return hf_target, None, "none"
    draft_pt = _load_sdpa(src)
    desc = f"{src} (fp32, from {found})"
    if int8 and hf_draft == "dynamic_int8":
        draft_pt, desc = _dynamic_int8_draft(draft_pt, src, found, _onnx_int8_scheme(draft_dir), notes)
    elif int8 and hf_draft == "weight_int8":
        desc = _weight_int8_draft(draft_pt, src, found, draft_dir, notes)
    elif int8:
        notes.append("hf_assisted draft = the fp32 HF source of the int8 ONNX draft (hf_draft='fp32')")
    gc = draft_pt.generation_config
    # transformers reads these from the ASSISTANT's generation_config (kwargs of target.generate() do not reach
    # the candidate generator); confidence threshold 0 = always draft γ tokens, as specdec does.
    gc.num_assistant_tokens = gamma
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    return hf_target, draft_pt, desc


def _load_sdpa(model_dir: Path) -> Any:
    """An HF causal LM in float32 with SDPA attention, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    return m.eval()


def _dynamic_int8_draft(draft_pt: Any, src: Path, found: str, onnx_q: str, notes: list[str]) -> tuple[Any, str]:
    """``draft_pt`` with torch dynamic int8 quantization of every Linear, and its description; the fp32 draft when
    that API is unavailable (with a note)."""
    import torch

    try:
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated (still works in 2.13)
            draft_pt = quantize_dynamic(
                draft_pt, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8
            )
        desc = f"{src} + torch.ao.quantization.quantize_dynamic(Linear, qint8 per-channel; from {found})"
        notes.append(
            "hf_assisted draft = the HF source of the ONNX draft with torch dynamic int8 quantization of every "
            "Linear (qint8 per-channel weights, per-tensor dynamic uint8 activations; torch.ao.quantization is "
            f"deprecated in torch {torch.__version__} but works). The ONNX draft is quantized differently "
            f"({onnx_q}); see overall.draft_top1_agreement for how close each draft is to the target"
        )
    except Exception as e:  # noqa: BLE001 - API removed in a future torch
        notes.append(f"torch dynamic int8 quantization failed ({type(e).__name__}: {e}); hf_assisted uses the fp32 "
                     "PyTorch draft instead")
        desc = f"{src} (fp32: int8 quantization unavailable)"
    return draft_pt, desc


def _weight_int8_draft(draft_pt: Any, src: Path, found: str, draft_dir: Path, notes: list[str]) -> str:
    """Round ``draft_pt``'s weights to int8 per block like the ONNX draft (in place); returns its description."""
    block = 32
    try:
        block = int(json.loads((draft_dir / "specdec_export.json").read_text())["int8"]["block_size"])
    except Exception:  # noqa: BLE001
        pass
    n = _fake_quantize_blockwise_(draft_pt, block_size=block)
    notes.append(
        f"hf_assisted draft = float32 emulation of the ONNX draft's int8 weights (symmetric, block {block}); "
        f"the ONNX draft ({_onnx_int8_scheme(draft_dir)}) also quantizes activations, this one computes in "
        "float32 — about the same acceptance, float32 speed (slower than the ONNX int8 draft)"
    )
    return f"{src} + int8 weight rounding per block of {block} in float32 ({n} Linears; from {found})"


def _onnx_int8_scheme(draft_dir: Path) -> str:
    """How the ONNX draft was quantized, from its specdec_export.json (for the notes)."""
    from specdec.models import EXPORT_REPORT

    try:
        info = json.loads((draft_dir / EXPORT_REPORT).read_text())
    except (OSError, ValueError):
        return "unknown"
    q = info.get("int8")
    if isinstance(q, dict) and q:
        return ", ".join(f"{k}={v}" for k, v in q.items())
    return "ONNX Runtime dynamic int8 (per-channel MatMul weights)" if info.get("quantized_int8") else "none (fp32)"


class _CallCounter:
    """Counts forward calls of a torch module (target forward passes of HF assisted generation)."""

    def __init__(self, module):
        self.calls = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.calls += 1

    def remove(self):
        self._handle.remove()


def generate_hf_assisted(hf_target: Any, draft_pt: Any, ids: list[int], n_new: int, gamma: int,
                          eos: set[int] | frozenset[int], sampling: Any = None) -> VariantSample:
    """One HF assisted generation (constant γ, EOS as the verifier's); num_steps = target forward calls.

    ``sampling``: a :class:`common.types.SamplingParams`; None or temperature 0 = greedy. Otherwise
    ``do_sample=True`` with the same temperature, top-k (0 = off) and top-p, seeded with ``torch.manual_seed``
    when a seed is given.
    """
    import torch

    sample_kw: dict[str, Any] = {"do_sample": False}
    if sampling is not None and not sampling.greedy:
        sample_kw = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
                     "top_p": sampling.top_p}
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
    counter = _CallCounter(hf_target)
    try:
        input_ids = torch.tensor([ids], dtype=torch.long)
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf_target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                assistant_model=draft_pt,
                **sample_kw,
                max_new_tokens=n_new,
                num_assistant_tokens=gamma,
                num_assistant_tokens_schedule="constant",
                eos_token_id=sorted(eos) or None,
                pad_token_id=(sorted(eos) or [0])[0],
            )
        wall = time.perf_counter() - t
    finally:
        counter.remove()
    return VariantSample(out[0, len(ids):].tolist(), wall, num_steps=counter.calls)
