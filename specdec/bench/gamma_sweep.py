"""The γ sweep (:func:`run_gamma_sweep`, ``specdec bench --gamma-sweep 1-8``): target-only decoding, fixed γ each,
adaptive γ with and without confidence truncation, on one shared target; optional PNG plot."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
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
    time_draft_forward,
    package_versions,
    time_forward,
)
from .prompts import load_prompts
from specdec_runtime.common.types import DEFAULT_DRAFT_TOP_K

SWEEP_ADAPTIVE_VARIANTS = ("adaptive", "adaptive_no_truncation")


def _parse_int_list(spec: str, what: str) -> list[int]:
    """Integers of "1-8", "1,2,4,8" or a mix ("1-4,8"): sorted, unique. Raises InvalidRequestError."""
    from specdec_runtime.common.errors import InvalidRequestError

    out: set[int] = set()
    try:
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part[1:]:
                lo, hi = part.split("-", 1)
                lo_i, hi_i = int(lo), int(hi)
                if hi_i < lo_i:
                    raise ValueError
                out.update(range(lo_i, hi_i + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise InvalidRequestError(f"{what} must look like 1-8 or 1,2,4,8, got {spec!r}") from None
    if not out:
        raise InvalidRequestError(f"{what}: no values in {spec!r}")
    return sorted(out)


def parse_gamma_sweep(spec: str) -> list[int]:
    """γ values of ``--gamma-sweep`` ("1-8", "1,2,4,8", "1-4,8"), each >= 1. Raises InvalidRequestError."""
    from specdec_runtime.common.errors import InvalidRequestError

    gammas = _parse_int_list(spec, "--gamma-sweep")
    if gammas[0] < 1:
        raise InvalidRequestError(f"--gamma-sweep values must be >= 1, got {spec!r}")
    return gammas


def _target_only_metrics(results: list[PromptResult]) -> dict:
    base = [r.samples["target_only"] for r in results]
    tokens = sum(len(s.token_ids) for s in base)
    steps = sum(s.num_steps for s in base)
    fwd = sum(s.target_forward_s for s in base)
    return {
        "tokens_per_s": safe_ratio(tokens, sum(s.wall_s for s in base)),
        "target_ms_per_token": safe_ratio(1000.0 * fwd, tokens),
        "target_forward_ms_1_token": safe_ratio(1000.0 * fwd, steps),  # one 1-token verify step = one forward
        "num_prompts": len(base),
        "num_tokens": tokens,
    }


def _sweep_metrics(results: list[PromptResult], v: str) -> dict:
    """M of one sweep variant over ``results`` (ratios of sums), against target_only on the same prompts."""
    ss = [r.samples[v] for r in results]
    base = _target_only_metrics(results)
    tokens = sum(len(s.token_ids) for s in ss)
    steps = sum(s.num_steps for s in ss)
    drafted = sum(s.num_draft_tokens for s in ss)
    accepted = sum(s.num_accepted_tokens for s in ss)
    tps = safe_ratio(tokens, sum(s.wall_s for s in ss))
    draft_ms = safe_ratio(1000.0 * sum(s.draft_s for s in ss), drafted)
    tgt_ms = safe_ratio(1000.0 * sum(s.target_forward_s for s in ss), tokens)
    fwd1 = base["target_forward_ms_1_token"]
    return {
        "acceptance_rate": safe_ratio(accepted, drafted) or 0.0,
        "mean_accepted_length": 1.0 + accepted / steps if steps else None,
        "mean_block_tokens": safe_ratio(drafted, steps),
        "draft_ms_per_token": draft_ms,
        "draft_cost_ratio": safe_ratio(draft_ms, fwd1) if draft_ms is not None and fwd1 else None,
        "tokens_per_s": tps,
        "speedup_vs_target_only": safe_ratio(tps, base["tokens_per_s"]) if tps and base["tokens_per_s"] else None,
        "target_ms_per_token": tgt_ms,
        "target_ms_per_token_vs_target_only": (
            safe_ratio(tgt_ms, base["target_ms_per_token"]) if tgt_ms is not None and base["target_ms_per_token"] else None
        ),
        "num_prompts": len(ss),
        "num_tokens": tokens,
        "num_steps": steps,
    }


def _per_category(results: list[PromptResult], fn) -> dict:
    return {
        "overall": fn(results),
        "categories": {c: fn([r for r in results if r.prompt.category == c]) for c in categories_of(results)},
    }


def _check_plot_available() -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError("--plot needs matplotlib, an optional dependency: pip install matplotlib")


def run_gamma_sweep(
    prompts: Path,
    gammas: list[int],
    *,
    limit: int | None = None,
    max_new_tokens: int = 128,
    target: Path | None = None,
    draft: Path | None = None,
    min_confidence: float = 0.3,
    adaptive_max_num_speculative_tokens: int | None = None,
    progress: bool = False,
    plot: Path | None = None,
) -> dict:
    """γ sweep, greedy, in one process sharing ONE target (TargetRunner/Verifier behind the in-process
    LocalBackend): per prompt, interleaved (the order rotates from prompt to prompt), target-only decoding,
    fixed γ for each γ in ``gammas`` (no confidence truncation, no proactive drafting), and adaptive γ
    (``EdgeClient(adaptive=True, num_speculative_tokens=adaptive_max_num_speculative_tokens or max(gammas))``)
    with confidence truncation at ``min_confidence`` ("adaptive") and without ("adaptive_no_truncation"). One
    ModelDrafter serves every variant; its draft KV cache is reset before each generation so each pays the same draft
    prefill.

    Returns ``{"gamma_sweep": {"1": M, ..., "adaptive": M, "adaptive_no_truncation": M}, "target_only":
    {"overall", "categories"}, "greedy_agreement": {variant: {...}}, "config": {...}, "notes": [...]}`` with
    M = ``{"overall": m, "categories": {name: m}}`` and m = acceptance_rate, mean_accepted_length,
    mean_block_tokens, draft_ms_per_token, draft_cost_ratio (draft ms per drafted token / the in-run target
    one-token forward of target-only decoding), tokens_per_s, speedup_vs_target_only, target_ms_per_token
    (+ its ratio to target-only's), num_prompts, num_tokens, num_steps. With ``plot``, a PNG of speedup and
    τ against γ is written there (needs matplotlib).

    Raises:
        FileNotFoundError, InvalidRequestError, ModelNotFoundError, VocabMismatchError; ImportError when
        ``plot`` is given and matplotlib is missing (checked before anything runs).
    """
    gammas, amax = _check_sweep_args(gammas, max_new_tokens, min_confidence, adaptive_max_num_speculative_tokens, plot)
    questions = load_prompts(prompts, limit)
    target_dir, draft_dir = resolve_dirs(target, draft)
    notes = _sweep_notes(amax, min_confidence)
    t_setup = time.perf_counter()
    rig = _SweepRig.open(target_dir, draft_dir, gammas, amax, min_confidence)
    results: list[PromptResult] = []
    try:
        setup_s = time.perf_counter() - t_setup
        t_run = time.perf_counter()
        results.extend(run_interleaved(questions, rig.tokenizer, rig.variants, rig.run_variant, max_new_tokens,
                                        progress, "γ sweep", rig.postfix))
        run_s = time.perf_counter() - t_run
        fwd1, draft_fwd1 = rig.microbench()
    finally:
        rig.close()

    variants = rig.variants
    sweep = {v: _per_category(results, lambda rs, v=v: _sweep_metrics(rs, v)) for v in variants[1:]}
    agreement = greedy_agreement_of(results, variants, "target_only")
    bad = {v: a["of"] - a["identical"] for v, a in agreement.items() if a["mismatches"]}
    if bad:
        notes.append(f"BUG: greedy output differs from target-only (same TargetRunner: must be identical): {bad}")
    config = _sweep_config(prompts, limit, results, bad, max_new_tokens=max_new_tokens, gammas=gammas, amax=amax,
                           min_confidence=min_confidence, target_dir=target_dir, draft_dir=draft_dir, fwd1=fwd1,
                           draft_fwd1=draft_fwd1, setup_s=setup_s, run_s=run_s)
    report = {
        "gamma_sweep": sweep,
        "target_only": _per_category(results, _target_only_metrics),
        "greedy_agreement": agreement,
        "config": config,
        "notes": notes,
    }
    if plot is not None:
        config["plot"] = str(plot_gamma_sweep(report, plot))
    return report


def _sweep_config(prompts: Path, limit: int | None, results: list[PromptResult], bad: dict, *, max_new_tokens: int,
                  gammas: list[int], amax: int, min_confidence: float, target_dir: Path, draft_dir: Path, fwd1: float,
                  draft_fwd1: float, setup_s: float, run_s: float) -> dict:
    return {
        "prompts": str(Path(prompts).expanduser()),
        "limit": limit,
        "num_prompts": len(results),
        "categories": categories_of(results),
        "selection": "round-robin across categories" if limit is not None else "all, file order",
        "turn": "first turn of each question, chat template",
        "max_new_tokens": max_new_tokens,
        "gammas": gammas,
        "adaptive_max_num_speculative_tokens": amax,
        "min_confidence": min_confidence,
        "decoding": "greedy",
        "greedy_identical_all": not bad,
        "target": str(target_dir),
        "draft": str(draft_dir),
        "backend": "LocalBackend (in-process verifier)",
        "microbench_ms": {  # single-row forwards after 100 cached tokens, medians of 9, after the run
            "target_forward_1_token": fwd1,
            "draft_forward_1_token": draft_fwd1,
            "draft_cost_ratio": safe_ratio(draft_fwd1, fwd1),
        },
        "cpu_count": os.cpu_count(),
        "threading": threading_config(),
        "versions": package_versions(),
        "setup_s": round(setup_s, 2),
        "run_s": round(run_s, 2),
    }


def _check_sweep_args(gammas: list[int], max_new_tokens: int, min_confidence: float,
                      adaptive_max_num_speculative_tokens: int | None, plot: Path | None) -> tuple[list[int], int]:
    """(sorted unique γ values, the adaptive variants' largest γ). Raises InvalidRequestError, or ImportError when
    ``plot`` is given and matplotlib is missing."""
    from specdec_runtime.common.errors import InvalidRequestError

    gammas = sorted(set(int(g) for g in gammas))
    if not gammas or gammas[0] < 1:
        raise InvalidRequestError(f"γ values must be >= 1, got {gammas}")
    if max_new_tokens < 1:
        raise InvalidRequestError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not 0.0 <= min_confidence < 1.0:
        raise InvalidRequestError(f"--min-confidence must be in [0, 1), got {min_confidence}")
    amax = int(adaptive_max_num_speculative_tokens or max(gammas))
    if amax < 1:
        raise InvalidRequestError(
            f"adaptive_max_num_speculative_tokens must be >= 1, got {adaptive_max_num_speculative_tokens}")
    if plot is not None:
        _check_plot_available()
    return gammas, amax


def _sweep_notes(amax: int, min_confidence: float) -> list[str]:
    return [
        "all variants share one TargetRunner/Verifier behind the in-process LocalBackend (no network, no proactive "
        "drafting); variants run interleaved per prompt, their order rotating from prompt to prompt",
        "fixed-γ variants draft exactly γ tokens per block (no confidence truncation); 'adaptive' chooses γ ≤ "
        f"{amax} per step (edge_client.generation.policy) with confidence truncation at min_confidence={min_confidence}, "
        "'adaptive_no_truncation' the same without truncation",
        "draft_ms_per_token = edge drafting time (the draft KV sync incl. the prompt's draft prefill, and the γ "
        "forwards) / drafted tokens; draft_cost_ratio divides it by the target's one-token forward measured in "
        "this run (target_only.target_forward_ms_1_token), speedup = tokens/s over target-only's on the same "
        "prompts; every rate is a ratio of sums",
        noise_note(),
    ]


@dataclass
class _SweepRig:
    """ONE TargetRunner/Verifier behind the in-process LocalBackend and one EdgeClient per sweep variant, all sharing
    one ModelDrafter (its draft KV cache reset before each generation)."""

    runner: Any
    verifier: Any
    backend: Any
    draft_model: Any
    drafter: Any
    clients: dict[str, Any]

    @classmethod
    def open(cls, target_dir: Path, draft_dir: Path, gammas: list[int], amax: int, min_confidence: float) -> _SweepRig:
        """Raises InvalidRequestError when a γ exceeds the verifier's max_num_speculative_tokens."""
        from specdec_runtime.cloud_verifier.verifier import Verifier
        from specdec_runtime.common.errors import InvalidRequestError
        from specdec_runtime.edge_client.client import EdgeClient
        from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
        from specdec.embedded import LocalBackend

        draft_model, runner, valid_vocab = load_pair(target_dir, draft_dir)
        verifier = Verifier(runner)
        if max(max(gammas), amax) > verifier.info.max_num_speculative_tokens:
            raise InvalidRequestError(
                f"γ up to {max(max(gammas), amax)} exceeds the verifier's max_num_speculative_tokens "
                f"({verifier.info.max_num_speculative_tokens})"
            )
        backend = LocalBackend(verifier)
        tokenizer = draft_model.tokenizer
        drafter = ModelDrafter(draft_model, draft_top_k=DEFAULT_DRAFT_TOP_K, valid_vocab_size=valid_vocab)
        clients: dict[str, EdgeClient] = {"target_only": EdgeClient(backend, None, tokenizer)}
        for g in gammas:
            clients[str(g)] = EdgeClient(backend, drafter, tokenizer, num_speculative_tokens=g)
        clients["adaptive"] = EdgeClient(
            backend, drafter, tokenizer, num_speculative_tokens=amax, adaptive=True, min_confidence=min_confidence
        )
        clients["adaptive_no_truncation"] = EdgeClient(
            backend, drafter, tokenizer, num_speculative_tokens=amax, adaptive=True, min_confidence=0.0
        )
        return cls(runner, verifier, backend, draft_model, drafter, clients)

    @property
    def tokenizer(self) -> Any:
        return self.draft_model.tokenizer

    @property
    def variants(self) -> list[str]:
        return list(self.clients)

    def run_variant(self, v: str, ids: list[int], n_new: int) -> VariantSample:
        client = self.clients[v]
        if client.drafter is not None:
            self.drafter.reset()
        t = time.perf_counter()
        res = client.generate(ids, max_new_tokens=n_new, temperature=0.0)
        return sample_of(res, time.perf_counter() - t)

    def postfix(self, results: list[PromptResult]) -> str:
        best = max(
            ((v, _sweep_metrics(results, v)["speedup_vs_target_only"] or 0.0) for v in self.variants[1:]),
            key=lambda x: x[1],
        )
        return f"best {best[0]} ×{best[1]:.2f}"

    def microbench(self) -> tuple[float, float]:
        """(target, draft) one-token forward ms after 100 cached tokens, medians of 9."""
        fwd1 = time_forward(self.runner, 1, past_tokens=100, repeats=9)
        draft_fwd1 = time_draft_forward(self.draft_model, past_tokens=100, repeats=9)
        self.drafter.reset()
        return fwd1, draft_fwd1

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.backend.close()  # shared by every client: closed once
        with contextlib.suppress(Exception):
            self.verifier.shutdown()


def plot_gamma_sweep(report: dict, path: str | os.PathLike) -> Path:
    """PNG of a :func:`run_gamma_sweep` report: speedup over target-only and τ against γ (overall bold,
    categories thin), adaptive variants as horizontal lines. Needs matplotlib (ImportError otherwise)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib, an optional dependency: pip install matplotlib") from None

    sweep = report["gamma_sweep"]
    fixed = sorted((int(k) for k in sweep if k.isdigit()))
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    axes = fig.subplots(1, 2)
    panels = (
        ("speedup_vs_target_only", "speedup over target-only (×)"),
        ("mean_accepted_length", "τ (tokens / verify step)"),
    )
    cats = list(report.get("target_only", {}).get("categories", {}))
    styles = {"adaptive": ("tab:red", "--"), "adaptive_no_truncation": ("tab:purple", ":")}
    for ax, (key, label) in zip(axes, panels):
        for c in cats:
            ys = [sweep[str(g)]["categories"].get(c, {}).get(key) for g in fixed]
            if any(y is not None for y in ys):
                ax.plot(fixed, [float("nan") if y is None else y for y in ys], lw=0.8, alpha=0.45, label=c)
        ys = [sweep[str(g)]["overall"][key] for g in fixed]
        ax.plot(fixed, [float("nan") if y is None else y for y in ys], "o-", color="black", lw=2.2,
                label="overall (fixed γ)")
        for name, (color, ls) in styles.items():
            y = sweep.get(name, {}).get("overall", {}).get(key)
            if y is not None:
                ax.axhline(y, color=color, ls=ls, lw=1.8, label=f"{name.replace('_', ' ')} ({y:.2f})")
        if key == "speedup_vs_target_only":
            ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("γ (num_speculative_tokens)")
        ax.set_ylabel(label)
        ax.set_xticks(fixed)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    cfg = report.get("config", {})
    fig.suptitle(
        f"γ sweep (greedy, {cfg.get('num_prompts', '?')} prompts, ≤{cfg.get('max_new_tokens', '?')} new tokens); "
        f"draft {Path(str(cfg.get('draft', '?'))).name}",
        fontsize=10,
    )
    fig.savefig(path, dpi=120)
    return path
