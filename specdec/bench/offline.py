"""The Spec-Bench-style offline benchmark (:func:`run_bench`): target-only vs specdec vs HF assisted generation,
interleaved per prompt, in one process; greedy by default, or sampled (temperature, top-k, top-p, seed) with the
same settings for all three variants."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._shared import (
    greedy_agreement_of,
    categories_of,
    load_pair,
    noise_note,
    PromptResult,
    safe_ratio,
    resolve_dirs,
    run_interleaved,
    VariantSample,
    sample_of,
    threading_config,
    package_versions,
    time_forward,
)
from .hf_assisted import HF_DRAFT_MODES, generate_hf_assisted, load_hf_models
from .prompts import load_prompts
from specdec_runtime.common.types import DEFAULT_DRAFT_TOP_K

VARIANTS = ("target_only", "specdec", "hf_assisted")


def _summarize(results: list[PromptResult], variants: list[str]) -> dict:
    """The metrics M of a set of prompts (ratios of sums)."""

    def tot(v: str, attr: str) -> float:
        return sum(getattr(r.samples[v], attr) for r in results if v in r.samples)

    def ntok(v: str) -> int:
        return sum(len(r.samples[v].token_ids) for r in results if v in r.samples)

    tps = {v: (safe_ratio(ntok(v), tot(v, "wall_s")) if v in variants else None) for v in VARIANTS}
    spec_steps = tot("specdec", "num_steps")
    spec_drafted = tot("specdec", "num_draft_tokens")
    spec_accepted = tot("specdec", "num_accepted_tokens")
    m = {
        "acceptance_rate": safe_ratio(spec_accepted, spec_drafted) or 0.0,
        "mean_accepted_length": 1.0 + spec_accepted / spec_steps if spec_steps else None,
        "tokens_per_s": tps,
        "speedup_vs_target_only": {
            v: (safe_ratio(tps[v], tps["target_only"]) if tps[v] is not None and tps["target_only"] else None)
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
        m["hf_assisted_mean_accepted_length"] = safe_ratio(ntok("hf_assisted"), hf_steps)
    return m


def _draft_top1_agreement(results: list[PromptResult], draft_model, valid_vocab: int, draft_pt) -> dict:
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
    sampling: Any = None,
) -> dict:
    """Spec-Bench-style run: target-only vs specdec vs HF assisted generation, interleaved per prompt.

    ``sampling``: a :class:`common.types.SamplingParams` applied to all three variants (None = greedy). Greedy runs
    compare token ids with target-only (``greedy_agreement``); sampled runs cannot be compared token by token, so
    the report's ``sampled_reproducibility`` re-runs the first prompts with the same seed and checks that each
    variant of ours gives the same token ids again (null without a seed), and ``logits_processing_ms`` gives the
    cost of logits processing per position (edge: one row; verifier: a [γ + 1, vocab] block).

    Returns ``{"overall": M, "categories": {name: M}, "config": {...}, "greedy_agreement": {...}, "notes": [...]}``
    with M = acceptance_rate, mean_accepted_length, tokens_per_s / speedup_vs_target_only per variant,
    target_ms_per_token, num_prompts, num_tokens (overall adds draft_ms_per_token, draft_cost_ratio,
    target_forward_ms and, with ``measure_draft_agreement``, draft_top1_agreement: how often each draft's argmax
    equals the target's greedy token along the target-only outputs). Unavailable numbers are None.

    ``hf_draft``: the PyTorch form of an int8 ONNX draft for HF assisted generation, see :func:`load_hf_models`.

    Raises:
        FileNotFoundError, InvalidRequestError (prompts), ModelNotFoundError (models), VocabMismatchError.
    """
    from specdec_runtime.common.types import SamplingParams

    sampling = sampling or SamplingParams()
    _check_bench_args(max_new_tokens, num_speculative_tokens, hf_draft, sampling)
    questions = load_prompts(prompts, limit)
    target_dir, draft_dir = resolve_dirs(target, draft)
    notes: list[str] = [
        "target_only and specdec share one TargetRunner/Verifier behind the in-process LocalBackend (no network); "
        "variants run interleaved per prompt, their order rotating from prompt to prompt",
        noise_note(),
    ]
    t_setup = time.perf_counter()
    rig = _OfflineRig.open(target_dir, draft_dir, num_speculative_tokens, sampling)
    try:
        if hf_assisted and sampling.has_history_processors:  # HF's assisted generation here runs without them
            notes.append("hf_assisted skipped: penalties / logit_bias / min_tokens are not passed to HF generate")
        elif hf_assisted:
            rig.load_hf_assisted(target_dir, draft_dir, notes, hf_draft)
        setup_s = time.perf_counter() - t_setup
        gamma_eff = min(num_speculative_tokens, rig.verifier.info.max_num_speculative_tokens)
        if gamma_eff != num_speculative_tokens:
            notes.append(f"γ capped at the verifier's max_num_speculative_tokens = {gamma_eff}")
        t_run = time.perf_counter()
        results = run_interleaved(questions, rig.tokenizer, rig.variants, rig.run_variant, max_new_tokens, progress,
                                   "bench", rig.postfix)
        run_s = time.perf_counter() - t_run
        fwd1, fwd_block, top1 = rig.measure_costs(results, gamma_eff, measure_draft_agreement and sampling.greedy)
        reproducibility = None if sampling.greedy else rig.reproducibility(results, max_new_tokens)
    finally:
        rig.close()

    overall, categories, agreement = _summaries(results, rig, sampling, (fwd1, fwd_block, gamma_eff, top1), notes)
    predicted = _predicted_speedup(overall, gamma_eff, fwd1, fwd_block, notes)
    config = _bench_config(
        prompts, limit, len(results), sampling, max_new_tokens=max_new_tokens,
        num_speculative_tokens=num_speculative_tokens, gamma_eff=gamma_eff, target_dir=target_dir,
        draft_dir=draft_dir, rig_config=rig.config(hf_assisted, hf_draft), setup_s=setup_s, run_s=run_s,
        predicted=predicted)
    sampled = {} if sampling.greedy else {"sampled_reproducibility": reproducibility}
    return {"overall": overall, "categories": categories, "config": config, "greedy_agreement": agreement,
            "notes": notes, **sampled}


def _summaries(results: list, rig: Any, sampling: Any, costs: tuple, notes: list[str]) -> tuple[dict, dict, Any]:
    """The report's ``overall`` (with the logits processing costs, ms per position), ``categories`` and
    ``greedy_agreement`` (None when sampled) of :func:`run_bench`'s ``results``; ``costs`` = (fwd1, fwd_block,
    gamma_eff, top1) as measured by the rig."""
    fwd1, fwd_block, gamma_eff, top1 = costs
    overall = _overall_metrics(results, rig.variants, fwd1, fwd_block, gamma_eff, top1)
    categories = {c: _summarize([r for r in results if r.prompt.category == c], rig.variants)
                  for c in categories_of(results)}
    agreement = _greedy_agreement(results, rig.variants, notes) if sampling.greedy else None
    if not sampling.greedy:
        overall["logits_processing_ms"] = _logits_processing_ms(sampling, rig.valid_vocab, gamma_eff)
    if sampling.has_history_processors:  # penalties / bias / min_tokens: their cost per position, ms
        overall["history_processing_ms"] = _history_processing_ms(sampling, rig.valid_vocab)
    if not sampling.greedy:  # greedy runs compare outputs token by token (greedy_agreement), penalties or not
        notes.append("sampled: outputs are not compared token by token; sampled_reproducibility re-runs the first "
                     "prompts with the same seed (null without --seed)")
    return overall, categories, agreement


def _bench_config(prompts: Path, limit: int | None, num_prompts: int, sampling: Any, *, max_new_tokens: int,
                  num_speculative_tokens: int, gamma_eff: int, target_dir: Path, draft_dir: Path, rig_config: dict,
                  setup_s: float, run_s: float, predicted: Any) -> dict:
    """The report's ``config``: what was run, on what, and how long it took."""
    return {
        "prompts": str(Path(prompts).expanduser()),
        "limit": limit,
        "num_prompts": num_prompts,
        "selection": "round-robin across categories" if limit is not None else "all, file order",
        "turn": "first turn of each question, chat template",
        "max_new_tokens": max_new_tokens,
        "num_speculative_tokens": num_speculative_tokens,
        "num_speculative_tokens_effective": gamma_eff,
        "decoding": "greedy" if sampling.greedy else "sampled",
        "sampling": dataclasses.asdict(sampling),
        "target": str(target_dir),
        "draft": str(draft_dir),
        **rig_config,
        "cpu_count": os.cpu_count(),
        "threading": threading_config(),
        "versions": package_versions(),
        "setup_s": round(setup_s, 2),
        "run_s": round(run_s, 2),
        "predicted_speedup_specdec": predicted,
    }


def _history_processing_ms(sampling: Any, vocab_size: int, history: int = 256, positions: int = 200) -> float:
    """Median ms per position of the history-dependent processors (common.logits_processors) after a history of
    ``history`` distinct-ish tokens, each position pushing one more (the block's incremental cost)."""
    import numpy as np

    from specdec_runtime.common.logits_processors import TokenHistory

    rng = np.random.default_rng(0)
    h = TokenHistory(sampling, vocab_size, history // 2, (), rng.integers(0, vocab_size, history).tolist())
    row = rng.normal(size=vocab_size).astype(np.float32)
    times = []
    for t in rng.integers(0, vocab_size, positions).tolist():
        x = row.copy()
        t0 = time.perf_counter()
        h.apply(x)
        h.push(t)
        times.append((time.perf_counter() - t0) * 1000)
    return round(float(np.median(times)), 4)


def _logits_processing_ms(sampling: Any, vocab_size: int, num_speculative_tokens: int) -> dict | None:
    """ms per position of logits processing with ``sampling`` (specdec.logits_bench), edge and verifier."""
    try:
        from specdec.logits_bench import bench_logits_processing
    except ImportError:
        return None
    settings = [(sampling.temperature, sampling.top_k, sampling.top_p)]
    return bench_logits_processing(vocab_size=vocab_size, num_rows=num_speculative_tokens + 1, settings=settings)


def _check_bench_args(max_new_tokens: int, num_speculative_tokens: int, hf_draft: str, sampling: Any) -> None:
    from specdec_runtime.common.errors import InvalidRequestError

    try:
        sampling.validate()
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    if max_new_tokens < 1:
        raise InvalidRequestError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if num_speculative_tokens < 1:
        raise InvalidRequestError(f"--num-speculative-tokens must be >= 1, got {num_speculative_tokens}")
    if hf_draft not in HF_DRAFT_MODES:
        raise InvalidRequestError(f"hf_draft must be one of {HF_DRAFT_MODES}, got {hf_draft!r}")


@dataclass
class _OfflineRig:
    """What :func:`run_bench` runs on: ONE TargetRunner/Verifier behind the in-process LocalBackend, shared by the
    target-only and the specdec EdgeClient, plus the HF target and PyTorch draft of assisted generation."""

    runner: Any
    verifier: Any
    backend: Any
    draft_model: Any
    valid_vocab: int
    clients: dict[str, Any]
    num_speculative_tokens: int
    variants: list[str] = field(default_factory=lambda: ["target_only", "specdec"])
    hf_target: Any = None
    draft_pt: Any = None
    draft_pt_desc: str | None = None
    sampling: Any = None  # common.types.SamplingParams of every variant

    @classmethod
    def open(cls, target_dir: Path, draft_dir: Path, num_speculative_tokens: int, sampling: Any) -> _OfflineRig:
        from specdec_runtime.cloud_verifier.verifier import Verifier
        from specdec_runtime.edge_client.client import EdgeClient
        from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
        from specdec.embedded import LocalBackend

        draft_model, runner, valid_vocab = load_pair(target_dir, draft_dir)
        verifier = Verifier(runner)
        backend = LocalBackend(verifier)
        tokenizer = draft_model.tokenizer
        clients = {
            "target_only": EdgeClient(backend, None, tokenizer, num_speculative_tokens=num_speculative_tokens),
            "specdec": EdgeClient(
                backend,
                ModelDrafter(draft_model, draft_top_k=DEFAULT_DRAFT_TOP_K, valid_vocab_size=valid_vocab),
                tokenizer,
                num_speculative_tokens=num_speculative_tokens,
            ),
        }
        return cls(runner, verifier, backend, draft_model, valid_vocab, clients, num_speculative_tokens,
                   sampling=sampling)

    @property
    def tokenizer(self) -> Any:
        return self.draft_model.tokenizer

    def load_hf_assisted(self, target_dir: Path, draft_dir: Path, notes: list[str], hf_draft: str) -> None:
        """Load the HF models; the hf_assisted variant runs when the draft's PyTorch form is known."""
        self.hf_target, self.draft_pt, self.draft_pt_desc = load_hf_models(
            target_dir, draft_dir, self.num_speculative_tokens, notes, hf_draft
        )
        if self.draft_pt is not None:
            self.variants.append("hf_assisted")

    def run_variant(self, v: str, ids: list[int], n_new: int) -> VariantSample:
        if v == "hf_assisted":
            return generate_hf_assisted(self.hf_target, self.draft_pt, ids, n_new, self.num_speculative_tokens,
                                         self.verifier.eos_token_ids, self.sampling)
        from specdec_runtime.edge_client.request import generation_options

        t = time.perf_counter()
        res = self.clients[v].generate(ids, max_new_tokens=n_new, **generation_options(self.sampling))
        return sample_of(res, time.perf_counter() - t)

    def reproducibility(self, results: list[PromptResult], max_new_tokens: int, num_prompts: int = 2) -> dict | None:
        """Seeded sampled runs again on the first ``num_prompts`` prompts: ``{variant: {"identical", "of"}}`` for
        target_only and specdec (HF's sampler is not ours to check); None without a seed."""
        if self.sampling.seed is None:
            return None
        out = {}
        for v in ("target_only", "specdec"):
            again = [self.run_variant(v, r.prompt_ids, max_new_tokens).token_ids for r in results[:num_prompts]]
            same = sum(a == r.samples[v].token_ids for a, r in zip(again, results))
            out[v] = {"identical": same, "of": len(again)}
        return out

    def postfix(self, results: list[PromptResult]) -> str:
        m = _summarize(results, self.variants)
        sp = m["speedup_vs_target_only"]
        return f"τ={m['mean_accepted_length'] or 0:.2f} specdec×{sp['specdec'] or 0:.2f}" + (
            f" hf×{sp['hf_assisted'] or 0:.2f}" if "hf_assisted" in self.variants else ""
        )

    def measure_costs(self, results: list[PromptResult], gamma_eff: int,
                      measure_draft_agreement: bool) -> tuple[float, float, dict | None]:
        """(target one-token forward ms, (γ+1)-token forward ms, draft top-1 agreement or None): single row, 100
        past tokens."""
        fwd1 = time_forward(self.runner, 1, past_tokens=100, repeats=9)
        fwd_block = time_forward(self.runner, gamma_eff + 1, past_tokens=100, repeats=9)
        top1 = None
        if measure_draft_agreement:
            top1 = _draft_top1_agreement(results, self.draft_model, self.valid_vocab, self.draft_pt)
        return fwd1, fwd_block, top1

    def config(self, hf_assisted: bool, hf_draft: str) -> dict:
        """The report's config fields about the HF assisted variant, the backend and the specdec client."""
        hf = "hf_assisted" in self.variants
        return {
            "hf_assisted": hf_assisted and hf,
            "hf_assisted_draft": self.draft_pt_desc,
            "hf_draft_mode": hf_draft if hf else None,
            "hf_assisted_settings": (
                {"num_assistant_tokens": self.num_speculative_tokens, "num_assistant_tokens_schedule": "constant",
                 "assistant_confidence_threshold": 0.0, "attn_implementation": "sdpa"}
                if hf else None
            ),
            "backend": "LocalBackend (in-process verifier)",
            "specdec_client": {  # EdgeClient drafting options (fixed γ, as HF assisted's constant schedule)
                k: getattr(self.clients["specdec"], k, None) for k in ("adaptive", "min_confidence", "proactive")
            },
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.backend.close()  # shared by both clients: closed once
        with contextlib.suppress(Exception):
            self.verifier.shutdown()


def _overall_metrics(results: list[PromptResult], variants: list[str], fwd1: float, fwd_block: float,
                     gamma_eff: int, top1: dict | None) -> dict:
    """M over every prompt plus the draft's cost (per drafted token, relative to a target forward), the target's
    forward times and, when measured, the drafts' top-1 agreement."""
    overall = _summarize(results, variants)
    drafted = sum(r.samples["specdec"].num_draft_tokens for r in results)
    draft_s = sum(r.samples["specdec"].draft_s for r in results)
    draft_ms_per_token = 1000.0 * draft_s / drafted if drafted else None
    overall["draft_ms_per_token"] = draft_ms_per_token
    overall["draft_cost_ratio"] = draft_ms_per_token / fwd1 if draft_ms_per_token is not None and fwd1 > 0 else None
    overall["target_forward_ms"] = {"1_token": fwd1, f"{gamma_eff + 1}_tokens": fwd_block}
    if top1 is not None:
        overall["draft_top1_agreement"] = top1
    return overall


def _greedy_agreement(results: list[PromptResult], variants: list[str], notes: list[str]) -> dict:
    """``{"<variant>_vs_target_only": {"identical", "of", "mismatches"}}``; notes on any mismatch."""
    agreement = {f"{v}_vs_target_only": a for v, a in greedy_agreement_of(results, variants, "target_only").items()}
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
    return agreement


def _predicted_speedup(overall: dict, gamma_eff: int, fwd1: float, fwd_block: float,
                       notes: list[str]) -> float | None:
    """τ / (γ·c + t(γ+1)/t(1)): Leviathan et al.'s cost model with the measured costs (with a note saying so);
    None when unmeasured."""
    if overall["draft_cost_ratio"] is None:
        return None
    c = overall["draft_cost_ratio"]
    tau = overall["mean_accepted_length"] or 0
    predicted = tau / (gamma_eff * c + fwd_block / fwd1) if fwd1 > 0 else None
    if predicted is not None:
        notes.append(
            "predicted_speedup_specdec = τ / (γ·draft_cost_ratio + t_target(γ+1 tokens)/t_target(1 token)), "
            "the cost model of Leviathan et al. with the measured forward times (prefill excluded)"
        )
    return predicted
