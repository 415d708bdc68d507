"""Prepared drafts side by side (``specdec bench --drafts int8,distilled,head``): one target, one in-process
verifier, every draft at a fixed γ and with adaptive γ against the same target-only baseline, interleaved per
prompt (:func:`specdec.bench._shared.run_interleaved`), greedy.

Per draft and mode the report gives what a user needs to tell what their own pair will give: acceptance rate,
mean accepted length τ, acceptance per draft position, the draft's cost per drafted token over the target's
one-token forward (c), tokens/s, the speedup over target-only measured, and the speedup that the measured
acceptance and cost predict (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Thm. 3.8: E[tokens per step] = (1 − α^(γ+1)) / (1 − α) for i.i.d. acceptance α, :func:`common.acceptance.
expected_tokens`; cost per step 1 + γ·c target forwards; speedup = their ratio), and whether the output was
token-identical to target-only decoding.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._shared import (
    greedy_agreement_of, noise_note, PromptResult, run_interleaved, safe_ratio, sample_of,
    threading_config, package_versions, time_draft_forward, time_forward, VariantSample,
)
from .prompts import load_prompts

__all__ = ["ADAPTIVE_MAX_NUM_SPECULATIVE_TOKENS", "parse_draft_names", "predicted_speedup", "run_drafts_bench"]

# adaptive γ's bound (as the γ sweep's adaptive variant at --gamma-sweep 1-8)
ADAPTIVE_MAX_NUM_SPECULATIVE_TOKENS = 8


def parse_draft_names(spec: str) -> list[str]:
    """``int8,distilled,head`` → the names, in order, without repeats.

    Raises:
        ValueError: an empty list or an empty name.
    """
    names = [n.strip() for n in (spec or "").split(",")]
    if not names or any(not n for n in names):
        raise ValueError(f"--drafts takes comma-separated draft names (int8, distilled, head or a directory), "
                         f"got {spec!r}")
    return list(dict.fromkeys(names))


def predicted_speedup(acceptance_rate: float, num_speculative_tokens: float, cost_ratio: float | None) -> float | None:
    """The speedup over target-only that acceptance rate α and draft cost c (a drafted token's time over the
    target's one-token forward) predict at γ: E[tokens per step] / (1 + γ·c), with E from
    :func:`common.acceptance.expected_tokens` (Leviathan et al. 2023, eq. 1, and their cost model with the
    verify pass priced as one forward). A fractional γ (adaptive: the mean block) takes the mean of the two
    integer γ around it. None without a cost."""
    from specdec_runtime.common.acceptance import expected_tokens

    if cost_ratio is None or num_speculative_tokens <= 0:
        return None
    lo = int(num_speculative_tokens)
    frac = num_speculative_tokens - lo
    tokens = (1 - frac) * expected_tokens([acceptance_rate] * lo) + frac * expected_tokens([acceptance_rate] * (lo + 1))
    return tokens / (1.0 + num_speculative_tokens * cost_ratio)


@dataclass
class _DraftsRig:
    """One TargetRunner/Verifier behind the in-process LocalBackend; a target-only client and, per draft, one
    drafter shared by a fixed-γ and an adaptive-γ client (its KV cache reset before every generation, so each
    pays the same draft prefill)."""

    runner: Any
    verifier: Any
    backend: Any
    tokenizer: Any
    clients: dict[str, Any]
    drafters: dict[str, Any]
    draft_dirs: dict[str, Path]

    @classmethod
    def open(cls, target_dir: Path, drafts: dict[str, Path], num_speculative_tokens: int) -> _DraftsRig:
        from specdec_runtime.cloud_verifier.target.runner import TargetRunner
        from specdec_runtime.cloud_verifier.verifier import Verifier
        from specdec_runtime.common.vocab import check_vocab_compatible
        from specdec_runtime.edge_client.client import EdgeClient
        from specdec.embedded import LocalBackend
        from specdec.models.named_drafts import drafter_for, load_draft_model

        from ._shared import current_target_placement

        runner = TargetRunner(target_dir, **current_target_placement())
        models = {name: load_draft_model(d) for name, d in drafts.items()}
        valid = {name: check_vocab_compatible(m.tokenizer, runner.tokenizer, m.vocab_size, runner.vocab_size)
                 for name, m in models.items()}
        verifier = Verifier(runner)
        backend = LocalBackend(verifier)
        tokenizer = runner.tokenizer
        clients = {"target_only": EdgeClient(backend, None, tokenizer, num_speculative_tokens=num_speculative_tokens)}
        drafters = {}
        for name, model in models.items():
            drafter = drafters[name] = drafter_for(model, valid_vocab_size=valid[name])
            clients[f"{name}/fixed"] = EdgeClient(backend, drafter, tokenizer,
                                                  num_speculative_tokens=num_speculative_tokens)
            clients[f"{name}/adaptive"] = EdgeClient(backend, drafter, tokenizer, adaptive=True, min_confidence=0.0,
                                                     num_speculative_tokens=ADAPTIVE_MAX_NUM_SPECULATIVE_TOKENS)
        return cls(runner, verifier, backend, tokenizer, clients, drafters, dict(drafts))

    @property
    def variants(self) -> list[str]:
        return list(self.clients)

    def run_variant(self, v: str, ids: list[int], n_new: int) -> VariantSample:
        drafter = self.clients[v].drafter
        if drafter is not None:
            drafter.reset()
        t = time.perf_counter()
        res = self.clients[v].generate(ids, max_new_tokens=n_new)
        return sample_of(res, time.perf_counter() - t)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.backend.close()
        with contextlib.suppress(Exception):
            self.verifier.shutdown()


def _variant_metrics(results: list[PromptResult], v: str, fwd1_ms: float, baseline_tps: float | None,
                     step_ms: float) -> dict:
    """One draft mode's figures over every prompt (ratios of sums); ``step_ms``: the draft's one-token step
    after 100 cached tokens, ms (the c of the prediction: the run's own draft time includes its prefills)."""
    samples = [r.samples[v] for r in results]
    tokens = sum(len(s.token_ids) for s in samples)
    steps, drafted = sum(s.num_steps for s in samples), sum(s.num_draft_tokens for s in samples)
    accepted = sum(s.num_accepted_tokens for s in samples)
    width = max((len(s.drafted_per_pos) for s in samples), default=0)

    def per_pos(attr: str) -> list[int]:
        return [sum(getattr(s, attr)[i] for s in samples if i < len(getattr(s, attr))) for i in range(width)]

    acc_pos, drafted_pos = per_pos("accepted_per_pos"), per_pos("drafted_per_pos")
    draft_ms = 1000.0 * sum(s.draft_s for s in samples) / drafted if drafted else None
    cost = draft_ms / fwd1_ms if draft_ms is not None and fwd1_ms > 0 else None
    alpha = safe_ratio(accepted, drafted) or 0.0
    mean_block = safe_ratio(drafted, steps) or 0.0
    tps = safe_ratio(tokens, sum(s.wall_s for s in samples))
    return {
        "acceptance_rate": alpha,
        "mean_accepted_length": 1.0 + accepted / steps if steps else None,
        "acceptance_per_position": [round(a / d, 4) if d else None for a, d in zip(acc_pos, drafted_pos)],
        "mean_draft_tokens_per_block": mean_block,
        "draft_ms_per_token": draft_ms,
        "draft_cost_ratio": cost,
        "tokens_per_s": tps,
        "speedup_vs_target_only": safe_ratio(tps, baseline_tps) if tps is not None and baseline_tps else None,
        "predicted_speedup": predicted_speedup(alpha, mean_block, step_ms / fwd1_ms if fwd1_ms > 0 else None),
        "num_tokens": tokens,
    }


def _files_mb(directory: Path) -> float:
    """The draft's files on the device (graphs, weights, tokenizer), MB: what the device stores and maps."""
    return round(sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file()) / 1e6, 1)


def run_drafts_bench(prompts: Path, drafts: list[str], *, limit: int | None = None, max_new_tokens: int = 96,
                     num_speculative_tokens: int = 4, target: Path | None = None, progress: bool = False) -> dict:
    """Every draft of ``drafts`` (names of :mod:`specdec.models.named_drafts`, or directories) at fixed γ =
    ``num_speculative_tokens`` and with adaptive γ ≤ :data:`ADAPTIVE_MAX_NUM_SPECULATIVE_TOKENS`, against one
    target-only baseline, greedy, interleaved per prompt in one process.

    Returns:
        ``{"mode": "drafts", "drafts": {name: {"dir", "kind", "files_mb", "fixed": M, "adaptive": M, "token_identical",
        "mismatches"}}, "target_only": {"tokens_per_s"}, "target_forward_ms", "config", "notes"}`` with M the
        figures of :func:`_variant_metrics` (acceptance_rate, mean_accepted_length, acceptance_per_position,
        draft_ms_per_token, draft_cost_ratio, tokens_per_s, speedup_vs_target_only, predicted_speedup).

    Raises:
        ModelNotFoundError: a draft not prepared (one line naming the command that prepares it), or the target.
        VocabMismatchError: a draft whose vocabulary is not the target's. InvalidRequestError: bad prompts/options.
    """
    from specdec.models.named_drafts import is_head_dir, resolve_named_draft
    from specdec_runtime.common.errors import InvalidRequestError
    from specdec_runtime.common.paths import resolve_target_dir

    if max_new_tokens < 1 or num_speculative_tokens < 1:
        raise InvalidRequestError("--max-new-tokens and --num-speculative-tokens must be >= 1")
    dirs = {name: resolve_named_draft(name) for name in drafts}  # every name checked before anything loads
    target_dir = resolve_target_dir(target)
    questions = load_prompts(prompts, limit)
    t0 = time.perf_counter()
    rig = _DraftsRig.open(target_dir, dirs, num_speculative_tokens)
    try:
        setup_s = time.perf_counter() - t0
        results = run_interleaved(questions, rig.tokenizer, rig.variants, rig.run_variant, max_new_tokens, progress,
                                  "drafts", lambda rs: "")
        fwd1 = time_forward(rig.runner, 1, past_tokens=100, repeats=9)
        fwd_block = time_forward(rig.runner, num_speculative_tokens + 1, past_tokens=100, repeats=9)
        step_ms = {name: time_draft_forward(drafter.model, past_tokens=100, repeats=9)
                   for name, drafter in rig.drafters.items()}
    finally:
        rig.close()
    base_tps = safe_ratio(sum(len(r.samples["target_only"].token_ids) for r in results),
                          sum(r.samples["target_only"].wall_s for r in results))
    agreement = greedy_agreement_of(results, rig.variants, "target_only")
    report_drafts = {}
    for name, d in dirs.items():
        modes = (f"{name}/fixed", f"{name}/adaptive")
        report_drafts[name] = {
            "dir": str(d), "kind": "head" if is_head_dir(d) else "model", "files_mb": _files_mb(d),
            "draft_step_ms": step_ms[name], "draft_step_cost_ratio": step_ms[name] / fwd1 if fwd1 > 0 else None,
            "fixed": _variant_metrics(results, modes[0], fwd1, base_tps, step_ms[name]),
            "adaptive": _variant_metrics(results, modes[1], fwd1, base_tps, step_ms[name]),
            "token_identical": all(not agreement[m]["mismatches"] for m in modes),
            "mismatches": {m.split("/")[1]: agreement[m]["mismatches"] for m in modes if agreement[m]["mismatches"]},
        }
    return {
        "mode": "drafts", "drafts": report_drafts, "target_only": {"tokens_per_s": base_tps},
        "target_forward_ms": {"1_token": fwd1, f"{num_speculative_tokens + 1}_tokens": fwd_block},
        "config": {"prompts": str(Path(prompts).expanduser()), "limit": limit, "num_prompts": len(results),
                   "max_new_tokens": max_new_tokens, "decoding": "greedy",
                   "num_speculative_tokens": num_speculative_tokens,
                   "adaptive_max_num_speculative_tokens": ADAPTIVE_MAX_NUM_SPECULATIVE_TOKENS,
                   "target": str(target_dir), "backend": "LocalBackend (in-process verifier)",
                   "threading": threading_config(), "versions": package_versions(),
                   "setup_s": round(setup_s, 2)},
        "notes": [
            "every variant runs interleaved per prompt against one target-only baseline; the draft's KV cache is "
            "reset before each generation (each pays its prefill)",
            "draft_cost_ratio = the run's draft ms per drafted token (its prefills and a head's feeding of the "
            "target's features included) / the target's one-token forward after 100 cached tokens; "
            "draft_step_cost_ratio = one drafted token's step after 100 cached tokens / that forward",
            "predicted_speedup = E(tokens per step) / (1 + γ·draft_step_cost_ratio), E = (1 − α^(γ+1)) / (1 − α) "
            "(Leviathan et al. 2023) with γ the mean drafted tokens per block; it prices the verify pass as one "
            "forward and leaves out prefill and per-step overheads",
            noise_note(),
        ],
    }
