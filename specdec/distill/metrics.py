"""How good a distilled draft is: held-out agreement with the target and simulated greedy speculation (PyTorch
draft or ONNX draft), and the cost of one draft forward next to the target's."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np

from specdec.distill.batching import length_batches, collate, draft_hidden_states, kd_loss


def replay_greedy_blocks(match, gamma: int) -> tuple[int, int, int]:
    """Simulate greedy speculative blocks of γ tokens along one answer.

    ``match[t]``: whether the draft's top-1 equals the target's greedy token at answer position t (teacher
    forcing). Each block drafts min(γ, remaining) tokens, accepts the matching prefix and commits one more token.
    Returns (accepted, drafted, verify steps).
    """
    accepted = drafted = steps = t = 0
    while t < len(match):
        g = min(gamma, len(match) - t)
        k = 0
        while k < g and match[t + k]:
            k += 1
        accepted += k
        drafted += g
        steps += 1
        t += k + 1
    return accepted, drafted, steps


def evaluate(draft: Any, records: list[dict], pad_id: int, lut: Any, batch_tokens: int = 4096,
             gamma: int = 4) -> dict[str, float]:
    """Held-out metrics (teacher forcing on the target's greedy answers).

    ``agreement``: fraction of answer positions where the draft's argmax is the target's greedy token (the
    greedy per-token acceptance probability); ``coverage``: fraction of those tokens inside the head vocabulary
    (the ceiling of agreement); ``sim_acceptance``: accepted/drafted of a greedy speculative loop with fixed
    ``gamma`` replayed on the answers (blocks restart after each rejection, as the real loop does);
    ``sim_tau``: its tokens per verify step.
    """
    import torch

    if not records:
        return {}
    head_ids = draft.lm_head.token_ids
    agree_n = cov_n = total = 0
    loss_sum = 0.0
    accepted = drafted = steps = 0
    draft.eval()
    with torch.no_grad():
        for batch in length_batches(records, batch_tokens, random.Random(0), shuffle=False):
            ids, mask, rows, cols, sub, tval, ans = collate(batch, pad_id, lut)
            h = draft_hidden_states(draft, ids, mask)[rows, cols]
            sl = draft.lm_head.subset_logits(h)
            loss, _ = kd_loss(sl, sub, tval)
            loss_sum += float(loss) * len(ans)
            pred = head_ids[sl.argmax(-1)]
            match = (pred == ans).numpy()
            agree_n += int(match.sum())
            cov_n += int((lut[ans] >= 0).sum())
            total += len(ans)
            # Replay greedy speculative blocks per answer.
            off = 0
            for r in batch:
                m = match[off : off + len(r["answer_ids"])]
                off += len(r["answer_ids"])
                a, d, n = replay_greedy_blocks(m, gamma)
                accepted, drafted, steps = accepted + a, drafted + d, steps + n
    return {
        "agreement": agree_n / max(total, 1),
        "coverage": cov_n / max(total, 1),
        "loss": loss_sum / max(total, 1),
        "sim_acceptance": accepted / max(drafted, 1),
        "sim_tau": (accepted + steps) / max(steps, 1),
        "tokens": total,
    }


def measure_costs(
    target_dir: str | os.PathLike,
    draft_dirs: dict[str, str | os.PathLike],
    *,
    past: int = 100,
    repeats: int = 30,
    threads: int = 1,
) -> dict[str, Any]:
    """Side-by-side cost of one single-token forward with ``past`` tokens of KV cache, median ms.

    The target runs in PyTorch (as the verifier runs it: float32, DynamicCache), each ONNX draft in ONNX
    Runtime (:class:`edge_client.drafting.onnx_draft.OnnxDraftModel`), all with ``threads`` threads, interleaved
    round-robin in one process so that machine load affects them alike.

    Returns:
        {"target_ms": ..., "drafts": {name: {"ms": ..., "ratio": draft/target}}, ...}
    """
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    torch.set_num_threads(int(threads))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 20000, past).tolist()
    with torch.no_grad():
        out = target(input_ids=torch.tensor([prefix]), use_cache=True)
    base_cache = out["cache"]

    def target_once() -> float:
        cache = DynamicCache()
        for i, layer in enumerate(base_cache.layers):
            cache.update(layer.keys, layer.values, i)
        t = time.perf_counter()
        with torch.no_grad():
            target(input_ids=torch.tensor([[123]]), cache=cache, use_cache=True,
                   position_ids=torch.tensor([[past]]))
        return (time.perf_counter() - t) * 1e3

    drafts = {name: OnnxDraftModel(d, providers=["CPUExecutionProvider"], intra_op_num_threads=threads)
              for name, d in draft_dirs.items()}
    for m in drafts.values():
        m.forward(prefix)

    def draft_once(m: Any) -> float:
        t = time.perf_counter()
        m.forward([123])
        dt = (time.perf_counter() - t) * 1e3
        m.rollback(past)
        return dt

    times: dict[str, list[float]] = {"target": []}
    times.update({n: [] for n in drafts})
    for _ in range(3):
        target_once()
        for m in drafts.values():
            draft_once(m)
    for _ in range(repeats):
        times["target"].append(target_once())
        for n, m in drafts.items():
            times[n].append(draft_once(m))
    tgt = float(np.median(times["target"]))
    return {
        "past": past,
        "threads": threads,
        "repeats": repeats,
        "target_ms": tgt,
        "drafts": {n: {"ms": float(np.median(times[n])), "ratio": float(np.median(times[n])) / tgt} for n in drafts},
    }


def evaluate_onnx(onnx_dir: str | os.PathLike, records: list[dict], threads: int = 1,
                  gamma: int = 4) -> dict[str, float]:
    """Held-out greedy agreement of an ONNX draft directory (teacher forcing, one sequence per run).

    Same metrics as :func:`evaluate` (``agreement``, ``sim_acceptance``, ``sim_tau``) for any ONNX draft in
    the layout of :mod:`specdec.models` (the distilled draft, its int8 variant, the int8 copy of the target).
    """
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    m = OnnxDraftModel(onnx_dir, providers=["CPUExecutionProvider"], intra_op_num_threads=threads)
    agree = total = accepted = drafted = steps = 0
    for r in records:
        p = r["prompt_ids"].tolist()
        a = r["answer_ids"].tolist()
        m.reset()
        logits = m.forward(p + a[:-1])[len(p) - 1 :]
        match = logits.argmax(-1) == r["topk_ids"][:, 0].numpy()
        agree += int(match.sum())
        total += len(match)
        a, d, n = replay_greedy_blocks(match, gamma)
        accepted, drafted, steps = accepted + a, drafted + d, steps + n
    return {
        "agreement": agree / max(total, 1),
        "sim_acceptance": accepted / max(drafted, 1),
        "sim_tau": (accepted + steps) / max(steps, 1),
        "tokens": total,
    }
