"""Records of target data as training inputs: length-bucketed batches, collation (answer positions, the teacher's
top-k in head-vocabulary indices), the top-k KL loss, the draft's hidden states."""

from __future__ import annotations

import random
from typing import Any


def length_batches(records: list[dict], batch_tokens: int, rng: random.Random, shuffle: bool = True) -> list[list[dict]]:
    """Length-bucketed batches with about ``batch_tokens`` (padded) tokens each."""
    order = list(range(len(records)))
    if shuffle:
        rng.shuffle(order)
    # Sort within windows of 256 by length: little padding, still random across windows.
    out: list[list[dict]] = []
    for w in range(0, len(order), 256):
        win = sorted(order[w : w + 256], key=lambda i: len(records[i]["prompt_ids"]) + len(records[i]["answer_ids"]))
        cur: list[dict] = []
        width = 0
        for i in win:
            r = records[i]
            n = len(r["prompt_ids"]) + len(r["answer_ids"]) - 1
            if cur and max(width, n) * (len(cur) + 1) > batch_tokens:
                out.append(cur)
                cur, width = [], 0
            cur.append(r)
            width = max(width, n)
        if cur:
            out.append(cur)
    if shuffle:
        rng.shuffle(out)
    return out


def collate(batch: list[dict], pad_id: int, lut: Any, topk: int | None = None):
    """input_ids/mask [B, T] (right padding), answer positions (flat), teacher (subset idx, logits) [M, K]."""
    import torch

    width = max(len(r["prompt_ids"]) + len(r["answer_ids"]) - 1 for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    rows, cols, t_idx, t_val, answers = [], [], [], [], []
    for b, r in enumerate(batch):
        p = r["prompt_ids"].long()
        a = r["answer_ids"].long()
        seq = torch.cat([p, a[:-1]])
        ids[b, : len(seq)] = seq
        mask[b, : len(seq)] = 1
        n = len(a)
        rows.append(torch.full((n,), b, dtype=torch.long))
        cols.append(torch.arange(len(p) - 1, len(p) - 1 + n))
        ti = r["topk_ids"].long()
        tv = r["topk_logits"].float()
        if topk is not None:
            ti, tv = ti[:, :topk], tv[:, :topk]
        t_idx.append(ti)
        t_val.append(tv)
        answers.append(r["topk_ids"][:, 0].long())  # the target's greedy token (== a when generated in fp32)
    rows_t, cols_t = torch.cat(rows), torch.cat(cols)
    t_idx_t = torch.cat(t_idx)
    sub = lut[t_idx_t]  # -1 outside the head vocabulary
    return ids, mask, rows_t, cols_t, sub, torch.cat(t_val), torch.cat(answers)


def kd_loss(sub_logits: Any, sub_idx: Any, t_logits: Any) -> tuple[Any, Any]:
    """Top-k forward KL (up to the teacher entropy): -sum_k p_k log q(k) with p over the in-head top-k."""
    import torch

    logq = torch.log_softmax(sub_logits.float(), dim=-1)
    valid = sub_idx >= 0
    tl = t_logits.masked_fill(~valid, float("-inf"))
    has = valid.any(-1)
    p = torch.softmax(tl[has], dim=-1)
    lq = logq[has].gather(-1, sub_idx[has].clamp(min=0))
    loss = -(p * lq).masked_fill(~valid[has], 0.0).sum(-1)
    return loss.mean(), has.float().mean()

def draft_hidden_states(draft: Any, ids: Any, mask: Any) -> Any:
    return draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
