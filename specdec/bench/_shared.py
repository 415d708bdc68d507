"""Helpers shared by the benchmarks: per-prompt samples, ratios, model loading, the interleaved run loop, timing,
greedy agreement and the config fields every report records."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .prompts import BenchPrompt

# OpenMP threads of torch that spin-wait at barriers are pathological on an oversubscribed machine (measured
# here with 2 cores and other jobs running: a 5-token target forward took 0.4-7 s with the default policy,
# 70-90 ms with PASSIVE). Only effective when set before torch loads its OpenMP runtime; the value in effect
# is recorded in the report's config. Set OMP_WAIT_POLICY yourself to override.
_TORCH_LOADED_BEFORE_BENCH = "torch" in sys.modules
_ENV_AT_IMPORT = frozenset(os.environ)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

WARMUP_NEW_TOKENS = 4  # tokens of the untimed warm-up generation of each variant

# Device and dtype of the target in every bench mode (``specdec bench --device/--dtype``): names as in
# cloud_verifier.target.runner.resolve_device / resolve_dtype. HF assisted generation stays on the CPU in float32.
_TARGET_PLACEMENT = {"device": "auto", "dtype": "auto"}


@contextlib.contextmanager
def target_placement(device: str = "auto", dtype: str = "auto"):
    """Run the benches inside the ``with`` body with the target on ``device`` in ``dtype``."""
    saved = dict(_TARGET_PLACEMENT)
    _TARGET_PLACEMENT.update(device=device, dtype=dtype)
    try:
        yield
    finally:
        _TARGET_PLACEMENT.update(saved)


def current_target_placement() -> dict:
    """{"device", "dtype"} of the target for TargetRunner(...) (``auto`` allowed)."""
    return dict(_TARGET_PLACEMENT)


@dataclass
class VariantSample:
    """One variant's run on one prompt."""

    token_ids: list[int]
    wall_s: float
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    target_forward_s: float = 0.0
    draft_s: float = 0.0
    num_proactive_hits: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted draft tokens by block position
    drafted_per_pos: list[int] = field(default_factory=list)  # judged draft tokens by block position


@dataclass
class PromptResult:
    prompt: BenchPrompt
    prompt_len: int
    prompt_ids: list[int] = field(default_factory=list)
    samples: dict[str, VariantSample] = field(default_factory=dict)


def _first_diff(a: list[int], b: list[int]) -> int:
    """First position where a and b differ (len of the shorter when one is a prefix of the other); -1 if equal."""
    if a == b:
        return -1
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def safe_ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def resolve_dirs(target, draft) -> tuple[Path, Path]:
    from specdec.models import default_model_paths, resolve_draft_dir, resolve_target_dir

    defaults = default_model_paths()
    return resolve_target_dir(target or defaults.target_dir), resolve_draft_dir(draft or defaults.draft_dir)


def threading_config() -> dict:
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "omp_wait_policy_effective": not _TORCH_LOADED_BEFORE_BENCH or "OMP_WAIT_POLICY" in _ENV_AT_IMPORT,
    }


def package_versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "onnxruntime"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    return out


def noise_note() -> str:
    return (f"tokens/s = generated tokens / wall time incl. prefill; {os.cpu_count()} CPU cores shared by the "
            "draft, the target and anything else on the machine, so timings are noisy")


def load_pair(target_dir: Path, draft_dir: Path):
    """(OnnxDraftModel, TargetRunner, valid vocab size) after checking that they share a vocabulary.

    Raises:
        common.vocab.VocabMismatchError: the draft's tokenizer differs from the target's.
    """
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.common.vocab import check_vocab_compatible
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    draft_model = OnnxDraftModel(draft_dir)
    runner = TargetRunner(target_dir, **current_target_placement())
    valid_vocab = check_vocab_compatible(
        draft_model.tokenizer, runner.tokenizer, draft_model.vocab_size, runner.vocab_size
    )
    return draft_model, runner, valid_vocab


def run_interleaved(questions, tokenizer, variants: list[str], run_variant, max_new_tokens: int, progress: bool,
                     desc: str, postfix) -> list[PromptResult]:
    """Run every variant on every question, interleaved per prompt with a rotating order (so load drift on a
    shared machine hits all variants alike), after an untimed warm-up of each variant; tqdm bar on stderr."""
    from specdec_runtime.edge_client.client import encode_prompt

    encoded = [encode_prompt(tokenizer, q.prompt, chat=True) for q in questions]
    for v in variants:  # untimed warm-up (ORT / torch first calls, allocator growth)
        run_variant(v, encoded[0], min(WARMUP_NEW_TOKENS, max_new_tokens))
    results: list[PromptResult] = []
    bar = progress_bar(progress, len(questions), desc, "prompt")
    try:
        for i, (q, ids) in enumerate(zip(questions, encoded)):
            r = PromptResult(q, len(ids), list(ids))
            k = i % len(variants)
            for v in variants[k:] + variants[:k]:
                r.samples[v] = run_variant(v, ids, max_new_tokens)
            results.append(r)
            if bar is not None:
                bar.set_postfix_str(postfix(results), refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return results


def progress_bar(enabled: bool, total: int, desc: str, unit: str) -> Any:
    """A tqdm bar on stderr, or None when disabled."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=True)


def sample_of(res, wall: float) -> VariantSample:
    s = res.stats
    return VariantSample(
        list(res.token_ids), wall, s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
        s.target_forward_s, s.draft_s, s.num_proactive_hits, list(s.num_accepted_tokens_per_pos),
        list(s.num_draft_tokens_per_pos),
    )


def greedy_agreement_of(results: list[PromptResult], variants: list[str], base: str) -> dict:
    """Per variant: how many prompts' greedy token ids are identical to ``base``'s, and where they first differ."""
    out = {}
    for v in variants:
        if v == base:
            continue
        mism = []
        for r in results:
            d = _first_diff(r.samples[base].token_ids, r.samples[v].token_ids)
            if d >= 0:
                mism.append({"question_id": r.prompt.question_id, "category": r.prompt.category, "first_diff": d})
        out[v] = {"identical": len(results) - len(mism), "of": len(results), "mismatches": mism}
    return out


def time_draft_forward(model, past_tokens: int = 100, repeats: int = 9) -> float:
    """Median wall time of a one-token forward of the ONNX draft after ``past_tokens`` cached tokens, ms; of a
    draft head (:class:`edge_client.drafting.head_model.OnnxHead`), one entry (a token and a feature) after as
    many cached entries: one drafted token's step."""
    import numpy as np

    width = getattr(model, "feature_request", None) and model.hidden_size  # a head: each entry has a feature

    def forward(ids: list[int]):
        if width:
            return model.forward(ids, np.ones((len(ids), width), np.float32))
        return model.forward(ids)

    model.reset()
    try:
        forward([1] * past_tokens)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            forward([1])
            times.append((time.perf_counter() - t) * 1000)
            model.rollback(past_tokens)
        return float(np.median(times))
    finally:
        model.reset()


def time_forward(runner, num_tokens: int, past_tokens: int = 100, repeats: int = 5) -> float:
    """Median wall time of a single-row forward of the target (:class:`cloud_verifier.target.runner.TargetRunner`) of
    ``num_tokens`` tokens after ``past_tokens`` cached tokens, ms."""
    import numpy as np

    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow

    kv = runner.allocate(past_tokens + num_tokens)
    try:
        ids = [1] * (past_tokens + num_tokens)
        if past_tokens:
            runner.forward([ForwardRow(kv, ids[:past_tokens], 0, "none")])
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            runner.forward([ForwardRow(kv, ids[past_tokens:], past_tokens, "all")])
            times.append((time.perf_counter() - t) * 1000)
        return float(np.median(times))
    finally:
        runner.free(kv)


def categories_of(results: list[PromptResult]) -> list[str]:
    return list(dict.fromkeys(r.prompt.category for r in results))
