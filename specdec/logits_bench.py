"""Microbenchmark of logits processing (common.sampling.logits_to_probs): fast path vs the full-sort reference.

Two call shapes, as the two sides make them:

- edge path: the draft's per-token call (edge_client.drafting.drafter, once per draft token): the sparse top-k q straight
  from one row of raw logits (``draft_topk_distribution``) vs the full-sort reference then
  ``draft_topk_from_probs``;
- verifier path: one block [γ + 1, vocab_size] (cloud_verifier, once per verify row); reported per position;
- edge step: the drafter's whole sampled per-token step (its q, one draw) vs the step it replaced (full-row top-k).

Logits are real when the default target (SmolLM2-135M-Instruct, ``specdec models prepare``) is in the model
cache and transformers loads it: one teacher-forced forward over a fixed chat prompt and answer, rows taken
from the answer's positions. Otherwise (or with ``synthetic=True``) they are synthetic, calibrated on those
real logits: a Gaussian body (σ 3.5) and a peaked head (the top token about 22 above the median, the next
ones 0.5-6 below the top). The verifier's probabilities are checked bit for bit against the reference; the
edge's q for the same token ids (its probabilities agree to rounding: the draft samples from the q it sends, whatever its last bits).

    python -m specdec.logits_bench [--vocab-size 49152] [--rows 5] [--repeats 30] [--synthetic]

prints the dict of :func:`bench_logits_processing` as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from specdec_runtime.common.sampling import (
    Stream,
    draft_topk_distribution,
    logits_to_probs,
    normalize_sparse,
    sample_from,
    draft_topk_from_probs,
    uniform,
)
from specdec_runtime.common.types import DEFAULT_DRAFT_TOP_K, SamplingParams
from specdec.logits_reference import logits_to_probs_reference

DEFAULT_SETTINGS: tuple[tuple[float, int, float], ...] = ((0.7, 0, 0.9), (0.7, 50, 1.0), (0.7, 0, 0.95), (1.0, 0, 1.0))

_PROMPT = "Why is the sky blue? Explain briefly."
_ANSWER = (
    "The sky appears blue because of a phenomenon called Rayleigh scattering. Sunlight is made of many colors, "
    "and when it enters the atmosphere it collides with gas molecules that are much smaller than the wavelength "
    "of visible light. These molecules scatter shorter wavelengths, such as blue and violet, much more strongly "
    "than longer wavelengths like red and orange. Our eyes are more sensitive to blue than to violet, and some "
    "violet light is absorbed high in the atmosphere, so the scattered light we see from every direction looks "
    "blue. At sunrise and sunset the light travels through more air, the blue is scattered away, and the sky "
    "turns red and orange."
)


def synthetic_logits(num_rows: int, vocab_size: int, seed: int = 0) -> np.ndarray:  # [num_rows, vocab_size] float32
    """Peaked LM-like logits: Gaussian body (σ 3.5), the top token ~22 above the body, a head of 32 below it."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 3.5, size=(num_rows, vocab_size))
    head = min(32, vocab_size)
    for row in logits:
        ids = rng.choice(vocab_size, size=head, replace=False)
        gaps = np.concatenate([[0.0], rng.exponential(0.6, size=head - 1)])
        gaps[1] += rng.uniform(0.0, 3.0)  # how far the runner-up trails: peaked to nearly flat heads
        row[ids] = 22.0 + rng.normal(0.0, 1.0) - np.cumsum(gaps)
    return logits.astype(np.float32)


def real_logits(num_rows: int, vocab_size: int) -> np.ndarray | None:  # [num_rows, vocab_size] float32, or None
    """Target logits at the answer positions of one forward of the default target; None when unavailable."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from specdec_runtime.common.paths import default_model_paths

        target_dir = default_model_paths().target_dir
        if not (target_dir / "config.json").is_file():
            return None
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": _PROMPT}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(_ANSWER, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids + answer_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float().numpy()  # [answer, vocab]
    except Exception:  # no model, no transformers, a model that does not load: synthetic logits instead
        return None
    if logits.shape[-1] != vocab_size or len(logits) < num_rows:
        return None
    return np.ascontiguousarray(logits)


def _draft_topk_from_probs_before(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """common.sampling.draft_topk_from_probs as it was before the partial selection (argpartition over the
    whole row), for the edge-step comparison only: after top-p most of the row is 0, and those ties make it take ~1-2 ms."""
    k = max(1, min(k, int(np.count_nonzero(probs > 0))))
    ids = np.argpartition(probs, len(probs) - k)[len(probs) - k :]
    ids = ids[np.argsort(-probs[ids], kind="stable")]
    top = probs[ids]
    return ids.astype(np.int64), (top / top.sum()).astype(np.float32)


def _edge_q_fast(row: np.ndarray, params: SamplingParams, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The drafter's q of one row [vocab_size] (edge_client.drafting.drafter)."""
    return draft_topk_distribution(row, params, k)


def _edge_q_reference(row: np.ndarray, params: SamplingParams, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The same q through the full-sort reference row and draft_topk_from_probs."""
    return draft_topk_from_probs(logits_to_probs_reference(row[None, :], params)[0], k)


def _edge_q_before(row: np.ndarray, params: SamplingParams, k: int) -> tuple[np.ndarray, np.ndarray]:
    """q as the drafter computed it before the partial selection (full-sort reference, argpartition top-k)."""
    return _draft_topk_from_probs_before(logits_to_probs_reference(row[None, :], params)[0], k)


def _edge_step(q_of: Callable, row: np.ndarray, params: SamplingParams, draft_top_k: int) -> int:
    """The drafter's sampled per-token step (edge_client.drafting.drafter): the sparse top-k q of the row [vocab_size],
    one draft token drawn from it."""
    ids, q = q_of(row, params, draft_top_k)
    return int(ids[sample_from(normalize_sparse(q), uniform(1, 0, Stream.DRAFT_SAMPLE))])


def _time_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall time of each of ``repeats`` calls of ``fn`` (after one warm-up call), ms."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _summary(per_call_ms: list[float], positions: int) -> dict[str, float]:
    """ms per position of the calls: median and best (the least disturbed by other load)."""
    return {
        "median": round(statistics.median(per_call_ms) / positions, 4),
        "min": round(min(per_call_ms) / positions, 4),
    }


def bench_logits_processing(
    vocab_size: int = 49152,
    num_rows: int = 5,  # γ + 1 rows of the verifier's block (γ = 4)
    repeats: int = 30,
    settings: Sequence[tuple[float, int, float]] = DEFAULT_SETTINGS,  # (temperature, top_k, top_p)
    synthetic: bool = False,
    seed: int = 0,
    draft_top_k: int = DEFAULT_DRAFT_TOP_K,  # k of top-k drafting in the edge step (the SDK's default)
) -> dict:
    """ms per position of logits processing, fast vs the full-sort reference, edge and verifier paths.

    edge: the drafter's q (``draft_topk_distribution`` with ``draft_top_k``) of each of the ``num_rows`` rows
    alone, ``repeats`` times each, vs the reference row then ``draft_topk_from_probs``. verifier: the
    [num_rows, vocab_size] block, ``repeats`` times, time divided by ``num_rows``. edge_step: the drafter's
    whole sampled per-token step (its q, one draw) per row, fast vs the full-row step (the reference and the old
    draft_topk_from_probs). Temperatures must be > 0 (sampled decoding).

    Returns:
        {"vocab_size", "num_rows", "repeats", "logits", "numpy", "python", "settings": [...]}, one entry per
        setting: {"temperature", "top_k", "top_p", "edge": {"fast", "reference"}, "verifier": {"fast",
        "reference"}, "edge_step": {"fast", "before"}, "speedup_edge", "speedup_verifier",
        "speedup_edge_step", "identical"}. Each timing is {"median", "min"} ms per position; speedups are
        ratios of medians; "identical" is True when every fast result equalled the reference's: the
        verifier's probabilities bit for bit, the edge's q token ids, and the edge step's draft token.
    """
    logits = None if synthetic else real_logits(num_rows, vocab_size)
    source = "real (default target, one forward)" if logits is not None else "synthetic"
    if logits is None:
        logits = synthetic_logits(num_rows, vocab_size, seed)
    else:
        stride = max(1, len(logits) // num_rows)  # spread the rows over the answer
        logits = np.ascontiguousarray(logits[::stride][:num_rows])
    results = []
    for temperature, top_k, top_p in settings:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        identical = all(
            np.array_equal(
                logits_to_probs(rows, params).view(np.uint64),
                logits_to_probs_reference(rows, params).view(np.uint64),
            )
            for rows in [logits, *(logits[i : i + 1] for i in range(num_rows))]
        ) and all(
            np.array_equal(_edge_q_fast(row, params, draft_top_k)[0], _edge_q_reference(row, params, draft_top_k)[0])
            and _edge_step(_edge_q_fast, row, params, draft_top_k)
            == _edge_step(_edge_q_before, row, params, draft_top_k)
            for row in logits
        )
        entry: dict = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        for path, variants in (
            ("edge", (("fast", _edge_q_fast), ("reference", _edge_q_reference))),
            ("verifier", (("fast", logits_to_probs), ("reference", logits_to_probs_reference))),
            ("edge_step", (("fast", _edge_q_fast), ("before", _edge_q_before))),
        ):
            entry[path] = {}
            for name, fn in variants:
                if path == "verifier":
                    entry[path][name] = _summary(_time_ms(lambda: fn(logits, params), repeats), num_rows)
                    continue
                per_call: list[float] = []
                for row in logits:  # [vocab_size], as the drafter holds it
                    if path == "edge":
                        per_call += _time_ms(lambda: fn(row, params, draft_top_k), repeats)
                    else:
                        per_call += _time_ms(lambda: _edge_step(fn, row, params, draft_top_k), repeats)
                entry[path][name] = _summary(per_call, 1)
            slow = entry[path]["before" if path == "edge_step" else "reference"]["median"]
            entry[f"speedup_{path}"] = round(slow / entry[path]["fast"]["median"], 1)
        entry["identical"] = identical
        results.append(entry)
    return {
        "vocab_size": vocab_size,
        "num_rows": num_rows,
        "repeats": repeats,
        "logits": source,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "settings": results,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.logits_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--rows", type=int, default=5, help="rows of the verifier block (γ + 1)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--synthetic", action="store_true", help="synthetic logits even when the target is present")
    args = parser.parse_args(argv)
    result = bench_logits_processing(args.vocab_size, args.rows, args.repeats, synthetic=args.synthetic)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
