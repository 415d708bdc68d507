"""Spec-Bench-style benchmarks (``specdec bench``).

:func:`run_bench` — per prompt, in one process and interleaved (the order of the variants rotates from prompt to
prompt, so a slow patch of a shared machine hits each variant alike):

- ``target_only``: the EdgeClient with no drafter (empty blocks: one target token per verify step);
- ``specdec``: the EdgeClient with the ONNX draft (:class:`edge_client.drafter.ModelDrafter`);
- ``hf_assisted``: HF transformers assisted generation, ``target.generate(assistant_model=draft_pt)``, with the
  PyTorch form of the draft (see :func:`draft_pytorch_source`).

(a) and (b) share ONE :class:`~cloud_verifier.target.TargetRunner` / :class:`~cloud_verifier.verifier.Verifier`
behind the in-process :class:`~edge_client.backend.LocalBackend`, so the target is loaded once and both pay the
same verifier overheads. (c) uses a separately loaded HF model with standard SDPA attention. All three decode
greedily from the same prompt token ids (chat template, first turn of each question) with the same
max_new_tokens and EOS; the report records whether their token ids agree.

:func:`run_clients_bench` — N concurrent edge clients (threads; each with its own ONNX draft session and gRPC
channel) against ONE verifier on loopback gRPC, batched vs the same verifier verifying one block per forward
pass (``max_batch_size=1``).

Every rate is a ratio of sums (total tokens / total wall time; accepted / drafted), never a mean of ratios.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# OpenMP threads of torch that spin-wait at barriers are pathological on an oversubscribed machine (measured
# here with 2 cores and other jobs running: a 5-token target forward took 0.4-7 s with the default policy,
# 70-90 ms with PASSIVE). Only effective when set before torch loads its OpenMP runtime; the value in effect
# is recorded in the report's config. Set OMP_WAIT_POLICY yourself to override.
_TORCH_LOADED_BEFORE_BENCH = "torch" in sys.modules
_ENV_AT_IMPORT = frozenset(os.environ)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

VARIANTS = ("target_only", "specdec", "hf_assisted")
WARMUP_NEW_TOKENS = 4  # tokens of the untimed warm-up generation of each variant
CLIENTS_DEFAULT_LIMIT = 8  # prompts of run_clients_bench when no limit is given (keeps the run bounded)


# --------------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class BenchPrompt:
    question_id: Any
    category: str
    prompt: str  # the first user turn


def load_prompts(path: str | os.PathLike, limit: int | None = None) -> list[BenchPrompt]:
    """Questions of a Spec-Bench-style jsonl (question_id, category, turns): the FIRST turn of each.

    With ``limit``, N questions are taken round-robin across categories (categories in order of first
    appearance, questions in file order within a category), so a small limit still covers every category.

    Raises:
        FileNotFoundError: no such file.
        InvalidRequestError: a line is not JSON or lacks a non-empty first turn; limit < 1; no questions.
    """
    from common.errors import InvalidRequestError

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no prompts file at {path}")
    if limit is not None and limit < 1:
        raise InvalidRequestError(f"--limit must be >= 1, got {limit}")
    questions: list[BenchPrompt] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            turns = obj.get("turns") if isinstance(obj, dict) else None
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
                raise InvalidRequestError(f"{path}:{lineno}: no non-empty first turn in 'turns'")
            questions.append(
                BenchPrompt(obj.get("question_id", lineno), str(obj.get("category") or "uncategorized"), turns[0])
            )
    if not questions:
        raise InvalidRequestError(f"{path}: no questions")
    if limit is None or limit >= len(questions):
        return questions
    by_category: dict[str, list[BenchPrompt]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    picked: list[BenchPrompt] = []
    rank = 0
    while len(picked) < limit:
        for items in by_category.values():
            if rank < len(items) and len(picked) < limit:
                picked.append(items[rank])
        rank += 1
    return picked


# --------------------------------------------------------------------------------------------- measurements


@dataclass
class _Sample:
    """One variant's run on one prompt."""

    token_ids: list[int]
    wall_s: float
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    target_forward_s: float = 0.0
    draft_s: float = 0.0


@dataclass
class _PromptResult:
    prompt: BenchPrompt
    prompt_len: int
    prompt_ids: list[int] = field(default_factory=list)
    samples: dict[str, _Sample] = field(default_factory=dict)


def _first_diff(a: list[int], b: list[int]) -> int:
    """First position where a and b differ (len of the shorter when one is a prefix of the other); -1 if equal."""
    if a == b:
        return -1
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _summarize(results: list[_PromptResult], variants: list[str]) -> dict:
    """The metrics M of a set of prompts (ratios of sums)."""

    def tot(v: str, attr: str) -> float:
        return sum(getattr(r.samples[v], attr) for r in results if v in r.samples)

    def ntok(v: str) -> int:
        return sum(len(r.samples[v].token_ids) for r in results if v in r.samples)

    tps = {v: (_ratio(ntok(v), tot(v, "wall_s")) if v in variants else None) for v in VARIANTS}
    spec_steps = tot("specdec", "num_steps")
    spec_drafted = tot("specdec", "num_draft_tokens")
    spec_accepted = tot("specdec", "num_accepted_tokens")
    m = {
        "acceptance_rate": _ratio(spec_accepted, spec_drafted) or 0.0,
        "mean_accepted_length": 1.0 + spec_accepted / spec_steps if spec_steps else None,
        "tokens_per_s": tps,
        "speedup_vs_target_only": {
            v: (_ratio(tps[v], tps["target_only"]) if tps[v] is not None and tps["target_only"] else None)
            for v in ("specdec", "hf_assisted")
        },
        "target_ms_per_token": {
            v: (1000.0 * tot(v, "target_forward_s") / ntok(v) if ntok(v) else None)
            for v in ("target_only", "specdec")
        },
        "num_prompts": len(results),
        "num_tokens": ntok("specdec"),
    }
    if "hf_assisted" in variants:
        hf_steps = tot("hf_assisted", "num_steps")
        m["hf_assisted_mean_accepted_length"] = _ratio(ntok("hf_assisted"), hf_steps)
    return m


# --------------------------------------------------------------------------------------------- HF assisted


def draft_pytorch_source(draft_dir: Path) -> tuple[Path | None, bool, str]:
    """Where the PyTorch form of an ONNX draft is: ``(hf_dir or None, int8: bool, how it was found)``.

    The ONNX draft directory records the HF directory it was exported from (``source`` in
    ``specdec_export.json`` / the completion marker, see :func:`common.models.export_onnx_draft`) and whether it
    was int8-quantized. None when nothing usable is recorded.
    """
    from common.models import COMPLETE_MARKER, EXPORT_REPORT, resolve_target_dir

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


def _load_hf_models(
    target_dir: Path, draft_dir: Path, gamma: int, notes: list[str], hf_draft: str = "dynamic_int8"
) -> tuple[Any, Any, str]:
    """(HF target with SDPA attention, PyTorch draft or None, description of the draft).

    ``hf_draft`` (used when the ONNX draft is int8): "dynamic_int8" = torch.ao dynamic int8 quantization of
    every Linear (real int8 kernels); "weight_int8" = float32 weights rounded to int8 per block like the ONNX
    draft's MatMulNBits (same weights as the ONNX draft, float32 speed); "fp32" = the unquantized source.
    """
    import torch
    from transformers import AutoModelForCausalLM

    def load(d: Path):
        m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="sdpa")
        return m.eval()

    hf_target = load(target_dir)
    src, int8, found = draft_pytorch_source(draft_dir)
    if src is None:
        notes.append(
            f"hf_assisted skipped: the draft {draft_dir} records no HF source directory (specdec_export.json "
            "'source'), so its PyTorch form is unknown"
        )
        return hf_target, None, "none"
    draft_pt = load(src)
    desc = f"{src} (fp32, from {found})"
    onnx_q = _onnx_int8_scheme(draft_dir)
    if int8 and hf_draft == "dynamic_int8":
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
    elif int8 and hf_draft == "weight_int8":
        block = 32
        try:
            block = int(json.loads((draft_dir / "specdec_export.json").read_text())["int8"]["block_size"])
        except Exception:  # noqa: BLE001
            pass
        n = _fake_quantize_blockwise_(draft_pt, block_size=block)
        desc = f"{src} + int8 weight rounding per block of {block} in float32 ({n} Linears; from {found})"
        notes.append(
            f"hf_assisted draft = float32 emulation of the ONNX draft's int8 weights (symmetric, block {block}); "
            f"the ONNX draft ({onnx_q}) also quantizes activations, this one computes in float32 — about the same "
            "acceptance, float32 speed (slower than the ONNX int8 draft)"
        )
    elif int8:
        notes.append("hf_assisted draft = the fp32 HF source of the int8 ONNX draft (hf_draft='fp32')")
    gc = draft_pt.generation_config
    # transformers reads these from the ASSISTANT's generation_config (kwargs of target.generate() do not reach
    # the candidate generator); confidence threshold 0 = always draft γ tokens, as specdec does.
    gc.num_assistant_tokens = gamma
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    return hf_target, draft_pt, desc


def _onnx_int8_scheme(draft_dir: Path) -> str:
    """How the ONNX draft was quantized, from its specdec_export.json (for the notes)."""
    from common.models import EXPORT_REPORT

    try:
        info = json.loads((draft_dir / EXPORT_REPORT).read_text())
    except (OSError, ValueError):
        return "unknown"
    q = info.get("int8")
    if isinstance(q, dict) and q:
        return ", ".join(f"{k}={v}" for k, v in q.items())
    return "ONNX Runtime dynamic int8 (per-channel MatMul weights)" if info.get("quantized_int8") else "none (fp32)"


def _draft_top1_agreement(results: list[_PromptResult], draft_model, valid_vocab: int, draft_pt) -> dict:
    """Teacher-forced top-1 agreement with the target along the target-only greedy outputs (whose tokens ARE the
    target's argmaxes): fraction of output positions where each draft's argmax is the target's token."""
    import numpy as np
    import torch

    hits = {"onnx_draft": 0, "hf_assisted_draft": 0}
    total = 0
    for r in results:
        out = r.samples["target_only"].token_ids
        if not out:
            continue
        seq = r.prompt_ids + out
        p = len(r.prompt_ids)
        ref = np.asarray(out)
        draft_model.reset()
        logits = draft_model.forward(seq[:-1])[p - 1 :, :valid_vocab]  # rows predicting seq[p:]
        hits["onnx_draft"] += int((logits.argmax(-1) == ref).sum())
        draft_model.reset()
        if draft_pt is not None:
            with torch.inference_mode():
                lg = draft_pt(input_ids=torch.tensor([seq[:-1]])).logits[0, p - 1 :, :valid_vocab]
            hits["hf_assisted_draft"] += int((lg.argmax(-1).numpy() == ref).sum())
        total += len(out)
    return {k: (v / total if total and (k == "onnx_draft" or draft_pt is not None) else None) for k, v in hits.items()}


class _CallCounter:
    """Counts forward calls of a torch module (target forward passes of HF assisted generation)."""

    def __init__(self, module):
        self.calls = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.calls += 1

    def remove(self):
        self._handle.remove()


# --------------------------------------------------------------------------------------------- run_bench


def _resolve_dirs(target, draft) -> tuple[Path, Path]:
    from common.models import default_model_paths, resolve_draft_dir, resolve_target_dir

    defaults = default_model_paths()
    return resolve_target_dir(target or defaults.target_dir), resolve_draft_dir(draft or defaults.draft_dir)


def _threading_config() -> dict:
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "omp_wait_policy_effective": not _TORCH_LOADED_BEFORE_BENCH or "OMP_WAIT_POLICY" in _ENV_AT_IMPORT,
    }


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "onnxruntime"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    return out


def run_bench(
    prompts: Path,
    *,
    limit: int | None = None,
    max_new_tokens: int = 128,
    num_speculative_tokens: int = 4,
    target: Path | None = None,
    draft: Path | None = None,
    hf_assisted: bool = True,
    progress: bool = False,
    hf_draft: str = "dynamic_int8",
    measure_draft_agreement: bool = True,
) -> dict:
    """Spec-Bench-style run: target-only vs specdec vs HF assisted generation, greedy, interleaved per prompt.

    Returns ``{"overall": M, "categories": {name: M}, "config": {...}, "greedy_agreement": {...}, "notes": [...]}``
    with M = acceptance_rate, mean_accepted_length, tokens_per_s / speedup_vs_target_only per variant,
    target_ms_per_token, num_prompts, num_tokens (overall adds draft_ms_per_token, draft_cost_ratio,
    target_forward_ms and, with ``measure_draft_agreement``, draft_top1_agreement: how often each draft's argmax
    equals the target's greedy token along the target-only outputs). Unavailable numbers are None.

    ``hf_draft``: the PyTorch form of an int8 ONNX draft for HF assisted generation, see :func:`_load_hf_models`.

    Raises:
        FileNotFoundError, InvalidRequestError (prompts), ModelNotFoundError (models), VocabMismatchError.
    """
    from common.errors import InvalidRequestError

    if max_new_tokens < 1:
        raise InvalidRequestError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if num_speculative_tokens < 1:
        raise InvalidRequestError(f"--num-speculative-tokens must be >= 1, got {num_speculative_tokens}")
    if hf_draft not in HF_DRAFT_MODES:
        raise InvalidRequestError(f"hf_draft must be one of {HF_DRAFT_MODES}, got {hf_draft!r}")
    questions = load_prompts(prompts, limit)
    target_dir, draft_dir = _resolve_dirs(target, draft)

    import torch

    from cloud_verifier.target import TargetRunner, time_forward
    from cloud_verifier.verifier import Verifier
    from common.vocab import check_vocab_compatible
    from edge_client.backend import LocalBackend
    from edge_client.client import EdgeClient, encode_prompt
    from edge_client.drafter import ModelDrafter
    from edge_client.onnx_draft import OnnxDraftModel

    notes: list[str] = [
        "target_only and specdec share one TargetRunner/Verifier behind the in-process LocalBackend (no network); "
        "variants run interleaved per prompt, their order rotating from prompt to prompt",
        f"tokens/s = generated tokens / wall time incl. prefill; {os.cpu_count()} CPU cores shared by the draft, "
        "the target and anything else on the machine, so timings are noisy",
    ]
    t_setup = time.perf_counter()
    draft_model = OnnxDraftModel(draft_dir)
    runner = TargetRunner(target_dir)
    valid_vocab = check_vocab_compatible(
        draft_model.tokenizer, runner.tokenizer, draft_model.vocab_size, runner.vocab_size
    )
    draft_model.valid_vocab_size = valid_vocab
    verifier = Verifier(runner)
    backend = LocalBackend(verifier)
    tokenizer = draft_model.tokenizer
    clients = {
        "target_only": EdgeClient(backend, None, tokenizer, num_speculative_tokens=num_speculative_tokens),
        "specdec": EdgeClient(
            backend,
            ModelDrafter(draft_model, draft_top_k=8, valid_vocab_size=valid_vocab),
            tokenizer,
            num_speculative_tokens=num_speculative_tokens,
        ),
    }
    variants = ["target_only", "specdec"]
    hf_target = draft_pt = None
    draft_pt_desc = None
    try:
        if hf_assisted:
            hf_target, draft_pt, draft_pt_desc = _load_hf_models(
                target_dir, draft_dir, num_speculative_tokens, notes, hf_draft
            )
            if draft_pt is not None:
                variants.append("hf_assisted")
        setup_s = time.perf_counter() - t_setup
        eos = verifier.eos_token_ids
        gamma_eff = min(num_speculative_tokens, verifier.info.max_block_tokens)
        if gamma_eff != num_speculative_tokens:
            notes.append(f"γ capped at the verifier's max_block_tokens = {gamma_eff}")

        def run_variant(v: str, ids: list[int], n_new: int) -> _Sample:
            if v == "hf_assisted":
                counter = _CallCounter(hf_target)
                try:
                    input_ids = torch.tensor([ids], dtype=torch.long)
                    t = time.perf_counter()
                    with torch.inference_mode():
                        out = hf_target.generate(
                            input_ids,
                            attention_mask=torch.ones_like(input_ids),
                            assistant_model=draft_pt,
                            do_sample=False,
                            max_new_tokens=n_new,
                            num_assistant_tokens=num_speculative_tokens,
                            num_assistant_tokens_schedule="constant",
                            eos_token_id=sorted(eos) or None,
                            pad_token_id=(sorted(eos) or [0])[0],
                        )
                    wall = time.perf_counter() - t
                finally:
                    counter.remove()
                return _Sample(out[0, len(ids):].tolist(), wall, num_steps=counter.calls)
            t = time.perf_counter()
            res = clients[v].generate(ids, max_new_tokens=n_new, temperature=0.0)
            wall = time.perf_counter() - t
            s = res.stats
            return _Sample(
                list(res.token_ids), wall, s.num_verify_steps, s.num_draft_tokens, s.num_accepted_tokens,
                s.target_forward_s, s.draft_s,
            )

        encoded = [encode_prompt(tokenizer, q.prompt, chat=True) for q in questions]
        # Untimed warm-up of every variant (ONNX Runtime / torch first-call costs, allocator growth).
        for v in variants:
            run_variant(v, encoded[0], min(WARMUP_NEW_TOKENS, max_new_tokens))

        results: list[_PromptResult] = []
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(questions), desc="bench", unit="prompt", file=sys.stderr, leave=True)
        t_run = time.perf_counter()
        try:
            for i, (q, ids) in enumerate(zip(questions, encoded)):
                r = _PromptResult(q, len(ids), list(ids))
                k = i % len(variants)
                for v in variants[k:] + variants[:k]:
                    r.samples[v] = run_variant(v, ids, max_new_tokens)
                results.append(r)
                if bar is not None:
                    m = _summarize(results, variants)
                    sp = m["speedup_vs_target_only"]
                    bar.set_postfix_str(
                        f"τ={m['mean_accepted_length'] or 0:.2f} specdec×{sp['specdec'] or 0:.2f}"
                        + (f" hf×{sp['hf_assisted'] or 0:.2f}" if "hf_assisted" in variants else ""),
                        refresh=False,
                    )
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        run_s = time.perf_counter() - t_run

        # Cost of the draft relative to the target, and the target's forward times (single row, 100 past tokens).
        fwd1 = time_forward(runner, 1, past_tokens=100, repeats=9)
        fwd_block = time_forward(runner, gamma_eff + 1, past_tokens=100, repeats=9)
        agreement_top1 = None
        if measure_draft_agreement:
            agreement_top1 = _draft_top1_agreement(results, draft_model, valid_vocab, draft_pt)
    finally:
        with contextlib.suppress(Exception):
            backend.close()  # shared by both clients: closed once
        with contextlib.suppress(Exception):
            verifier.shutdown()

    # ---- report
    overall = _summarize(results, variants)
    drafted = sum(r.samples["specdec"].num_draft_tokens for r in results)
    draft_s = sum(r.samples["specdec"].draft_s for r in results)
    draft_ms_per_token = 1000.0 * draft_s / drafted if drafted else None
    overall["draft_ms_per_token"] = draft_ms_per_token
    overall["draft_cost_ratio"] = draft_ms_per_token / fwd1 if draft_ms_per_token is not None and fwd1 > 0 else None
    overall["target_forward_ms"] = {"1_token": fwd1, f"{gamma_eff + 1}_tokens": fwd_block}
    if agreement_top1 is not None:
        overall["draft_top1_agreement"] = agreement_top1
    categories = {}
    for name in dict.fromkeys(r.prompt.category for r in results):
        categories[name] = _summarize([r for r in results if r.prompt.category == name], variants)

    agreement: dict[str, dict] = {}
    for v in variants[1:]:
        mism = []
        for r in results:
            d = _first_diff(r.samples["target_only"].token_ids, r.samples[v].token_ids)
            if d >= 0:
                mism.append({"question_id": r.prompt.question_id, "category": r.prompt.category, "first_diff": d})
        agreement[f"{v}_vs_target_only"] = {"identical": len(results) - len(mism), "of": len(results),
                                            "mismatches": mism}
    if agreement["specdec_vs_target_only"]["mismatches"]:
        notes.append(
            "BUG: specdec greedy output differs from target-only greedy output on "
            f"{len(agreement['specdec_vs_target_only']['mismatches'])} prompt(s) (same TargetRunner: must be identical)"
        )
    hf_key = "hf_assisted_vs_target_only"
    if hf_key in agreement and agreement[hf_key]["mismatches"]:
        notes.append(
            f"hf_assisted differs from target-only on {len(agreement[hf_key]['mismatches'])} prompt(s): it runs the "
            "HF model with SDPA attention and a DynamicCache, the verifier a custom ragged attention; fp32 rounding "
            "differences can flip near-tie argmaxes (compare first_diff positions)"
        )
    mean_draft_block = None
    if overall["draft_cost_ratio"] is not None:
        c = overall["draft_cost_ratio"]
        tau = overall["mean_accepted_length"] or 0
        mean_draft_block = tau / (gamma_eff * c + fwd_block / fwd1) if fwd1 > 0 else None
    config = {
        "prompts": str(Path(prompts).expanduser()),
        "limit": limit,
        "num_prompts": len(results),
        "selection": "round-robin across categories" if limit is not None else "all, file order",
        "turn": "first turn of each question, chat template",
        "max_new_tokens": max_new_tokens,
        "num_speculative_tokens": num_speculative_tokens,
        "num_speculative_tokens_effective": gamma_eff,
        "decoding": "greedy",
        "target": str(target_dir),
        "draft": str(draft_dir),
        "hf_assisted": hf_assisted and "hf_assisted" in variants,
        "hf_assisted_draft": draft_pt_desc,
        "hf_draft_mode": hf_draft if "hf_assisted" in variants else None,
        "hf_assisted_settings": (
            {"num_assistant_tokens": num_speculative_tokens, "num_assistant_tokens_schedule": "constant",
             "assistant_confidence_threshold": 0.0, "attn_implementation": "sdpa"}
            if "hf_assisted" in variants else None
        ),
        "backend": "LocalBackend (in-process verifier)",
        "specdec_client": {  # EdgeClient drafting options (fixed γ, as HF assisted's constant schedule)
            k: getattr(clients["specdec"], k, None) for k in ("adaptive", "min_confidence", "proactive")
        },
        "cpu_count": os.cpu_count(),
        "threading": _threading_config(),
        "versions": _versions(),
        "setup_s": round(setup_s, 2),
        "run_s": round(run_s, 2),
        "predicted_speedup_specdec": mean_draft_block,
    }
    if mean_draft_block is not None:
        notes.append(
            "predicted_speedup_specdec = τ / (γ·draft_cost_ratio + t_target(γ+1 tokens)/t_target(1 token)), "
            "the cost model of Leviathan et al. with the measured forward times (prefill excluded)"
        )
    return {"overall": overall, "categories": categories, "config": config, "greedy_agreement": agreement,
            "notes": notes}


# --------------------------------------------------------------------------------------------- clients bench


class _RecordingBackend:
    """Wraps a VerifierBackend and records the batch size of every verdict (one per verify step)."""

    def __init__(self, inner):
        self.inner = inner
        self.batch_sizes: list[int] = []
        self._lock = threading.Lock()

    def open_session(self, *args, **kwargs):
        return self.inner.open_session(*args, **kwargs)

    def submit(self, session_id, seq, committed_length, block) -> Future:
        fut = self.inner.submit(session_id, seq, committed_length, block)

        def done(f: Future) -> None:
            if not f.cancelled() and f.exception() is None:
                with self._lock:
                    self.batch_sizes.append(int(f.result().batch_size))

        fut.add_done_callback(done)
        return fut

    def close_session(self, session_id):
        return self.inner.close_session(session_id)

    def close(self):
        return self.inner.close()

    def take(self) -> list[int]:
        with self._lock:
            out, self.batch_sizes = self.batch_sizes, []
        return out


def _assign(n_items: int, n_clients: int) -> list[list[int]]:
    """Prompt indices per client: round-robin; when prompts < clients, client j gets prompt j mod n."""
    if n_items >= n_clients:
        return [list(range(j, n_items, n_clients)) for j in range(n_clients)]
    return [[j % n_items] for j in range(n_clients)]


def run_clients_bench(
    prompts: Path,
    client_counts: list[int],
    *,
    limit: int | None = None,
    max_new_tokens: int = 128,
    num_speculative_tokens: int = 4,
    target: Path | None = None,
    draft: Path | None = None,
    progress: bool = False,
    client_drafter: str = "model",
    max_batch_size: int = 32,
    rounds: int = 1,
    warmup_pass: bool = True,
) -> dict:
    """N concurrent edge clients against ONE verifier on loopback gRPC: batched vs one block per forward pass.

    For each N in ``client_counts``: N threads, each an EdgeClient with its own ONNX draft session
    (``client_drafter="model"``) or no drafter (``"none"``: target-only, empty blocks) and its own GrpcBackend,
    generate greedily for their share of the prompts (round-robin; when prompts < N, every client still gets
    one). After an untimed short warm-up pass (``warmup_pass``), each of ``rounds`` rounds runs the pass twice
    on the same server, once batched (``max_batch_size``) and once serial (``max_batch_size=1``), the order
    alternating from round to round; rates are summed over rounds (ratios of sums). Run time grows with
    sum over N of (1 + 2·rounds) passes of max(prompts, N) generations of up to ``max_new_tokens`` tokens.

    Returns ``{"clients": {"N": {"tokens_per_s", "per_session_tokens_per_s", "mean_batch_size",
    "speedup_vs_serial", "serial": {...}, ...}}, "config": {...}, "notes": [...]}``.
    """
    from common.errors import InvalidRequestError

    counts = list(dict.fromkeys(int(c) for c in client_counts))
    if rounds < 1:
        raise InvalidRequestError(f"rounds must be >= 1, got {rounds}")
    if not counts or min(counts) < 1:
        raise InvalidRequestError(f"client counts must be >= 1, got {client_counts}")
    if client_drafter not in ("model", "none"):
        raise InvalidRequestError(f"client_drafter must be 'model' or 'none', got {client_drafter!r}")
    if max_new_tokens < 1 or num_speculative_tokens < 1:
        raise InvalidRequestError("max_new_tokens and num_speculative_tokens must be >= 1")
    notes: list[str] = []
    if limit is None:
        limit = max(CLIENTS_DEFAULT_LIMIT, max(counts))
        notes.append(f"no --limit: {limit} prompts (round-robin across categories) to keep the run bounded")
    questions = load_prompts(prompts, limit)
    target_dir, draft_dir = _resolve_dirs(target, draft)

    from cloud_verifier.server import EmbeddedServer
    from cloud_verifier.target import TargetRunner
    from cloud_verifier.verifier import Verifier
    from common.vocab import check_vocab_compatible
    from edge_client.client import EdgeClient, encode_prompt
    from edge_client.drafter import ModelDrafter
    from edge_client.grpc_backend import GrpcBackend
    from edge_client.onnx_draft import OnnxDraftModel

    cpus = os.cpu_count() or 1
    notes.append(
        f"all edge clients and the verifier share this machine's {cpus} CPU cores: with N drafting clients the "
        "drafts compete with the target for CPU, so batching gains here understate a real deployment (drafts on "
        "the devices, target on an accelerator); client_drafter='none' isolates the verifier's batching"
    )
    draft_threads = max(1, cpus // max(counts))
    notes.append(f"each client's ONNX draft session uses {draft_threads} intra-op thread(s) (cores // max N)")
    runner = TargetRunner(target_dir)
    verifier = Verifier(runner, max_batch_size=max_batch_size, max_sessions=max(256, 2 * max(counts)))
    server = EmbeddedServer(verifier=verifier)
    address = server.start()
    pool: list[tuple[EdgeClient, _RecordingBackend]] = []
    report: dict[str, dict] = {}
    t0 = time.perf_counter()
    bar = None
    try:
        tokenizer = None
        valid = None
        encoded: list[list[int]] = []

        def new_client() -> tuple[EdgeClient, _RecordingBackend]:
            nonlocal tokenizer, valid, encoded
            model = OnnxDraftModel(draft_dir, intra_op_num_threads=draft_threads)
            if valid is None:
                valid = check_vocab_compatible(model.tokenizer, runner.tokenizer, model.vocab_size, runner.vocab_size)
                tokenizer = model.tokenizer
                encoded = [encode_prompt(tokenizer, q.prompt, chat=True) for q in questions]
            model.valid_vocab_size = valid
            rec = _RecordingBackend(GrpcBackend(address))
            drafter = ModelDrafter(model, draft_top_k=8, valid_vocab_size=valid) if client_drafter == "model" else None
            c = EdgeClient(rec, drafter, model.tokenizer, num_speculative_tokens=num_speculative_tokens)
            c.generate(encoded[0], max_new_tokens=min(WARMUP_NEW_TOKENS, max_new_tokens), temperature=0.0)  # warm-up
            rec.take()
            return c, rec

        total_passes = 2 * rounds * len(counts)
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total_passes, desc="clients bench", unit="pass", file=sys.stderr, leave=True)

        def run_pass(n: int, batch: int, n_new: int = max_new_tokens) -> tuple[list, float, list[int]]:
            """All N clients generate their shares concurrently; (results in share order, wall s, batch sizes)."""
            verifier.max_batch_size = batch  # read by the batcher before each batch
            shares = _assign(len(encoded), n)
            out: list[list] = [[] for _ in range(n)]
            errors: list[BaseException] = []

            def work(j: int) -> None:
                client, _ = pool[j]
                try:
                    for idx in shares[j]:
                        out[j].append(client.generate(encoded[idx], max_new_tokens=n_new, temperature=0.0))
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    errors.append(e)

            for _, rec in pool[:n]:
                rec.take()
            threads = [threading.Thread(target=work, args=(j,), name=f"bench-client-{j}") for j in range(n)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            wall = time.perf_counter() - t
            if errors:
                raise errors[0]
            return [r for rs in out for r in rs], wall, [b for _, rec in pool[:n] for b in rec.take()]

        def summarize(passes: list[tuple[list, float, list[int]]]) -> dict:
            results = [r for p in passes for r in p[0]]
            wall = sum(p[1] for p in passes)
            sizes = [b for p in passes for b in p[2]]
            tokens = sum(len(r.token_ids) for r in results)
            steps = sum(r.stats.num_verify_steps for r in results)
            drafted = sum(r.stats.num_draft_tokens for r in results)
            accepted = sum(r.stats.num_accepted_tokens for r in results)
            return {
                "tokens_per_s": _ratio(tokens, wall),
                "per_session_tokens_per_s": _ratio(tokens, sum(r.stats.elapsed_s for r in results)),
                "mean_batch_size": _ratio(sum(sizes), len(sizes)),
                "num_sessions": len(results),
                "num_tokens": tokens,
                "wall_s": wall,
                "wall_s_per_round": [round(p[1], 3) for p in passes],
                "acceptance_rate": _ratio(accepted, drafted),
                "mean_accepted_length": 1.0 + accepted / steps if steps else None,
            }

        k = 0
        for n in counts:
            while len(pool) < n:
                pool.append(new_client())
            if warmup_pass:  # untimed, short: every prompt's prefill shape, every client's channel and session
                run_pass(n, max_batch_size, min(WARMUP_NEW_TOKENS, max_new_tokens))
            passes: dict[int, list] = {max_batch_size: [], 1: []}
            for _ in range(rounds):
                order = [max_batch_size, 1] if k % 2 == 0 else [1, max_batch_size]
                k += 1
                for b in order:
                    passes[b].append(run_pass(n, b))
                    if bar is not None:
                        bar.set_postfix_str(f"N={n} batch≤{b}", refresh=False)
                        bar.update(1)
            ids_b = [[r.token_ids for r in p[0]] for p in passes[max_batch_size]]
            ids_s = [[r.token_ids for r in p[0]] for p in passes[1]]
            same = all(x == ids_b[0] for x in ids_b + ids_s)
            if not same:
                notes.append(f"N={n}: greedy outputs differ between passes (batched vs serial; must be identical)")
            batched, serial = summarize(passes[max_batch_size]), summarize(passes[1])
            report[str(n)] = {
                **batched,
                "speedup_vs_serial": _ratio(batched["tokens_per_s"] or 0, serial["tokens_per_s"] or 0),
                "greedy_identical_to_serial": same,
                "serial": serial,
            }
    finally:
        if bar is not None:
            bar.close()
        for c, _ in pool:
            with contextlib.suppress(Exception):
                c.close()
        with contextlib.suppress(Exception):
            server.stop()
        with contextlib.suppress(Exception):
            verifier.shutdown()
    config = {
        "prompts": str(Path(prompts).expanduser()),
        "limit": limit,
        "num_prompts": len(questions),
        "max_new_tokens": max_new_tokens,
        "num_speculative_tokens": num_speculative_tokens,
        "client_drafter": client_drafter,
        "max_batch_size": max_batch_size,
        "max_batch_wait_ms": verifier.max_batch_wait_s * 1000,
        "rounds": rounds,
        "warmup_pass": warmup_pass,
        "decoding": "greedy",
        "transport": "gRPC on loopback (EmbeddedServer), one GrpcBackend per client",
        "target": str(target_dir),
        "draft": str(draft_dir),
        "cpu_count": cpus,
        "threading": _threading_config(),
        "versions": _versions(),
        "run_s": round(time.perf_counter() - t0, 2),
    }
    notes.append(
        "tokens_per_s = committed tokens of all sessions / wall time of the pass; per_session_tokens_per_s = "
        "tokens / summed session time; mean_batch_size = mean Verdict.batch_size over verify steps"
    )
    notes.append(
        "acceptance can differ a little between client counts for the same prompts: each client's draft KV cache "
        "is reused across its sessions, and the int8 ONNX draft's logits depend slightly on how its cache was "
        "built (whole chunk vs token by token); the verifier's output does not"
    )
    return {"clients": report, "config": config, "notes": notes}


# --------------------------------------------------------------------------------------------- printing


def _fmt(x, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def print_report(report: dict, console=None) -> None:
    """Print a bench report (from run_bench or run_clients_bench) as rich tables."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        console.width = max(console.width, 140)  # the tables are wide; piped output defaults to 80 columns
    if "clients" in report:
        t = Table(title="Concurrent edge clients (one verifier, loopback gRPC)")
        for col in ("clients", "tok/s", "per-session tok/s", "mean batch", "serial tok/s", "speedup vs serial",
                    "τ", "sessions", "tokens"):
            t.add_column(col, justify="right")
        for n, m in report["clients"].items():
            s = m.get("serial", {})
            t.add_row(n, _fmt(m["tokens_per_s"], ".1f"), _fmt(m["per_session_tokens_per_s"], ".1f"),
                      _fmt(m["mean_batch_size"]), _fmt(s.get("tokens_per_s"), ".1f"), _fmt(m["speedup_vs_serial"]),
                      _fmt(m.get("mean_accepted_length")), str(m.get("num_sessions", "")),
                      str(m.get("num_tokens", "")))
        console.print(t)
    else:
        t = Table(title="Spec-Bench: target-only vs specdec vs HF assisted (greedy)")
        cols = ("category", "n", "tokens", "accept", "τ", "tok/s target", "tok/s specdec", "tok/s HF",
                "× specdec", "× HF", "tgt ms/tok target", "tgt ms/tok specdec")
        for c in cols:
            t.add_column(c, justify="left" if c == "category" else "right")

        def row(name: str, m: dict, style: str | None = None):
            tps, sp, tm = m["tokens_per_s"], m["speedup_vs_target_only"], m["target_ms_per_token"]
            t.add_row(
                name, str(m["num_prompts"]), str(m["num_tokens"]), _fmt(m["acceptance_rate"]),
                _fmt(m["mean_accepted_length"]), _fmt(tps["target_only"], ".1f"), _fmt(tps["specdec"], ".1f"),
                _fmt(tps["hf_assisted"], ".1f"), _fmt(sp["specdec"]), _fmt(sp["hf_assisted"]),
                _fmt(tm["target_only"], ".1f"), _fmt(tm["specdec"], ".1f"), style=style,
            )

        for name, m in report.get("categories", {}).items():
            row(name, m)
        row("overall", report["overall"], style="bold")
        console.print(t)
        o = report["overall"]
        fwd = o.get("target_forward_ms") or {}
        console.print(
            f"draft {_fmt(o.get('draft_ms_per_token'))} ms/drafted token; draft cost ratio c = "
            f"{_fmt(o.get('draft_cost_ratio'), '.3f')}; target forward "
            + ", ".join(f"{k.replace('_', ' ')}: {v:.1f} ms" for k, v in fwd.items())
            + (f"; HF assisted τ ≈ {_fmt(o.get('hf_assisted_mean_accepted_length'))}"
               if o.get("hf_assisted_mean_accepted_length") is not None else "")
        )
        for key, a in report.get("greedy_agreement", {}).items():
            diffs = f" (first diffs: {[m['first_diff'] for m in a['mismatches']]})" if a["mismatches"] else ""
            console.print(f"greedy {key.replace('_', ' ')}: {a['identical']}/{a['of']} identical{diffs}")
    for note in report.get("notes", []):
        console.print(f"[dim]note: {note}[/dim]")
