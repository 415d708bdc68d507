"""Distillation of a cheap draft model for a target (``specdec draft distill``; issue 5).

Recipe (DistillSpec, Zhou et al. 2024; FR-Spec, Zhao et al. 2025):

- **Architecture.** A ``LlamaForCausalLM`` with the target's hidden size and ``num_layers`` decoder layers
  initialised from target layers spread over its depth. It reuses the target's (tied) embedding matrix,
  frozen, and drafts only over the ``head_vocab`` tokens most frequent in target-generated text: its LM head
  is the target's LM head restricted to those rows (frozen), followed by a scatter into a full-vocabulary
  logits row that is ``-inf`` (a very negative number, :data:`MASKED_LOGIT`) elsewhere. The draft's q is
  therefore zero outside its vocabulary and rejection sampling stays exact. The trained tensors are the
  layers and the final norm only.
- **Data (on-policy).** The target's own greedy answers (chat template, at most ``max_new_tokens``) to the
  train prompts, generated in PyTorch in left-padded batches; each answer position stores the target's top-k
  logits (from the generation itself: no second target pass during training). Held-out prompts (a fixed
  hash-based fraction of the train prompts) are generated first and never trained on.
- **Loss.** Top-k forward KL: cross-entropy of the draft's log-softmax (over its head vocabulary) against the
  target's softmax over its stored top-k logits (renormalised, restricted to the head vocabulary), on the
  answer positions only. Held-out metric: greedy top-1 agreement of the draft with the target on the held-out
  answers (teacher forcing), which is the greedy per-token acceptance probability.

Everything lives in ``out_dir`` and is resumable: ``data/`` (generated shards + their plan), ``ckpt.pt``
(training state), ``artefact/`` (only the draft-specific weights, fp16, for committing), ``onnx/`` (the
exported ONNX draft), ``distill_report.json``. Data generation can also run in separate processes
(:func:`generate_target_data` with ``worker``/``num_workers``) while training reloads new shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

from specdec.models import (  # noqa: E402  (re-exported: the install path lives with the model registry)
    DISTILLED_MASKED_LOGIT as MASKED_LOGIT,
    install_distilled_draft,
)

__all__ = [
    "MASKED_LOGIT",
    "distill",
    "evaluate",
    "evaluate_onnx",
    "export_checkpoint",
    "frequent_token_ids",
    "front_back_layer_ids",
    "generate_target_data",
    "install_distilled_draft",
    "load_data",
    "load_prompts",
    "measure_costs",
]

DATA_DIR = "data"
CKPT_FILE = "ckpt.pt"
REPORT_FILE = "distill_report.json"


# ----------------------------------------------------------------------------------------------- prompts


def load_prompts(path: str | os.PathLike) -> list[str]:
    """Prompts of a JSONL file (field ``prompt``, or the first of ``turns``)."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            p = rec.get("prompt") or (rec.get("turns") or [None])[0]
            if p and p.strip():
                out.append(p)
    return out


def is_heldout(prompt: str, heldout_frac: float) -> bool:
    """Deterministic held-out split by a hash of the prompt text."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
    return (h % 100_000) < heldout_frac * 100_000


def _encode_chat(tokenizer: Any, prompt: str) -> list[int]:
    # Same encoding as edge_client.client.encode_prompt (one user turn, generation prompt).
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]


# ----------------------------------------------------------------------------------------------- data


def _shard_path(data_dir: Path, i: int) -> Path:
    return data_dir / f"shard_{i:05d}.pt"


def generate_target_data(
    target_dir: str | os.PathLike,
    data_dir: str | os.PathLike,
    prompts: list[str],
    *,
    heldout_frac: float = 0.03,
    max_heldout: int = 64,
    batch_size: int = 16,
    chunk_batches: int = 4,
    max_new_tokens: int = 128,
    max_prompt_tokens: int = 320,
    topk: int = 32,
    time_budget_s: float | None = None,
    max_shards: int | None = None,
    threads: int | None = None,
    seed: int = 0,
    worker: int = 0,
    num_workers: int = 1,
    gen_dtype: str = "bfloat16",
    progress: bool = True,
) -> dict[str, Any]:
    """Generate the target's greedy answers (+ top-k logits per answer position) into shards (resumable).

    The plan (which prompt goes to which shard) is fixed by ``seed`` and saved in ``data_dir/plan.json``:
    held-out prompts first (shards flagged ``heldout``), then the training prompts in a random order, in
    chunks of ``batch_size * chunk_batches`` prompts sorted by length within the chunk (less padding). Each
    shard is written atomically, so an interrupted run resumes at the first missing shard.

    Returns:
        dict with shards done, tokens, seconds.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(int(threads))
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    plan_path = data_dir / "plan.json"
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
    else:
        held = [i for i, p in enumerate(prompts) if is_heldout(p, heldout_frac)][:max_heldout]
        held_set = set(held)
        train = [i for i in range(len(prompts)) if i not in held_set and not is_heldout(prompts[i], heldout_frac)]
        random.Random(seed).shuffle(train)
        chunk = batch_size * chunk_batches
        shards = [{"prompts": held[j : j + chunk], "heldout": True} for j in range(0, len(held), chunk)]
        shards += [{"prompts": train[j : j + chunk], "heldout": False} for j in range(0, len(train), chunk)]
        plan = {
            "num_prompts": len(prompts),
            "heldout_frac": heldout_frac,
            "batch_size": batch_size,
            "max_new_tokens": max_new_tokens,
            "max_prompt_tokens": max_prompt_tokens,
            "topk": topk,
            "shards": shards,
        }
        plan_path.write_text(json.dumps(plan))
    # Held-out answers always come from the float32 target (honest metric); training answers from
    # ``gen_dtype`` (bfloat16 is ~2x faster on CPUs with AVX512-BF16; its top-k logits are a close soft
    # teacher, its greedy answers ~on-policy).
    model32 = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    model_gen = model32
    if gen_dtype != "float32":
        model_gen = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=getattr(torch, gen_dtype)).eval()
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    t0 = time.perf_counter()
    todo = [
        i for i in range(len(plan["shards"])) if i % num_workers == worker and not _shard_path(data_dir, i).is_file()
    ]
    if max_shards is not None:
        todo = todo[: max(0, max_shards - (len(plan["shards"]) - len(todo)))]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="target data", unit="shard")
    n_tokens = 0
    done = 0
    bs = plan["batch_size"]
    for si in todo:
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
        shard = plan["shards"][si]
        model = model32 if shard["heldout"] else model_gen
        encs = []
        for pi in shard["prompts"]:
            ids = _encode_chat(tok, prompts[pi])
            if len(ids) <= plan["max_prompt_tokens"]:
                encs.append((pi, ids))
        encs.sort(key=lambda e: len(e[1]))
        records = []
        ts = time.perf_counter()
        for b in range(0, len(encs), bs):
            batch = encs[b : b + bs]
            width = max(len(e[1]) for e in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, (_, ids) in enumerate(batch):
                input_ids[r, width - len(ids) :] = torch.tensor(ids)
                mask[r, width - len(ids) :] = 1
            for (pi, ids), (ans, ti, tv) in zip(
                batch, _greedy_batch(model, input_ids, mask, plan["max_new_tokens"], eos, plan["topk"])
            ):
                records.append(
                    {
                        "prompt_index": pi,
                        "prompt_ids": torch.tensor(ids, dtype=torch.int32),
                        "answer_ids": torch.tensor(ans, dtype=torch.int32),
                        "topk_ids": ti.to(torch.int32),
                        "topk_logits": tv.to(torch.float16),
                    }
                )
                n_tokens += len(ans)
        tmp = _shard_path(data_dir, si).with_suffix(f".tmp{os.getpid()}")
        torch.save({"heldout": shard["heldout"], "dtype": str(model.dtype), "records": records}, tmp)
        os.replace(tmp, _shard_path(data_dir, si))
        done += 1
        rate = sum(len(r["answer_ids"]) for r in records) / max(time.perf_counter() - ts, 1e-9)
        log.info("shard %d: %d answers, %.1f answer tok/s", si, len(records), rate)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{n_tokens} tok, {n_tokens / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
    if bar is not None:
        bar.close()
    total = sum(1 for i in range(len(plan["shards"])) if _shard_path(data_dir, i).is_file())
    return {"shards_done": total, "shards_planned": len(plan["shards"]), "new_tokens": n_tokens, "seconds": time.perf_counter() - t0}


def _greedy_batch(model: Any, input_ids: Any, mask: Any, max_new_tokens: int, eos: int, topk: int) -> list:
    """Greedy answers of a left-padded batch with the target's top-k logits at each answer position.

    Finished rows (EOS emitted) leave the batch at once (their KV-cache rows are dropped), so no compute is
    spent on padding after an answer ends. Returns per row (answer ids incl. EOS, topk ids [n, k] long,
    topk logits [n, k] float32).
    """
    import torch
    from transformers import DynamicCache

    b = input_ids.shape[0]
    answers: list[list[int]] = [[] for _ in range(b)]
    tids: list[list[Any]] = [[] for _ in range(b)]
    tvals: list[list[Any]] = [[] for _ in range(b)]
    alive = torch.arange(b)
    cache = DynamicCache(config=model.config)
    mask = mask.clone()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cur = input_ids
    with torch.no_grad():
        for step in range(max_new_tokens):
            out = model(input_ids=cur, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
            logits = out.logits[:, -1].float()
            v, i = logits.topk(topk, dim=-1)
            nxt = i[:, 0]
            keep = []
            for r in range(len(alive)):
                row = int(alive[r])
                answers[row].append(int(nxt[r]))
                tids[row].append(i[r])
                tvals[row].append(v[r])
                if int(nxt[r]) != eos:
                    keep.append(r)
            if not keep or step + 1 == max_new_tokens:
                break
            if len(keep) < len(alive):
                idx = torch.tensor(keep)
                for layer in cache.layers:
                    layer.keys = layer.keys.index_select(0, idx)
                    layer.values = layer.values.index_select(0, idx)
                alive, nxt, mask, pos = alive[idx], nxt[idx], mask[idx], pos[idx]
            mask = torch.cat([mask, torch.ones(len(alive), 1, dtype=mask.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            cur = nxt[:, None]
    return [(answers[r], torch.stack(tids[r]), torch.stack(tvals[r])) for r in range(b)]


def load_data(data_dir: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """(train records, held-out records) of every shard present."""
    import torch

    train, held = [], []
    for p in sorted(Path(data_dir).glob("shard_*.pt")):
        d = torch.load(p, weights_only=False)
        (held if d["heldout"] else train).extend(d["records"])
    return train, held


# ----------------------------------------------------------------------------------------------- head vocabulary


def frequent_token_ids(
    records: list[dict], vocab_size: int, head_vocab: int, always: tuple[int, ...] = (), prompt_weight: float = 0.1
) -> list[int]:
    """The ``head_vocab`` token ids most frequent in target-generated answers (FR-Spec).

    Counts answer tokens (weight 1) and prompt tokens (weight ``prompt_weight``, smoothing for a small
    corpus); ``always`` ids (EOS, chat markers) are included first; ties and unseen tokens are filled by
    ascending id (BPE merge order roughly follows frequency). Returns sorted ids.
    """
    counts = np.zeros(vocab_size, dtype=np.float64)
    for r in records:
        np.add.at(counts, np.asarray(r["answer_ids"], dtype=np.int64), 1.0)
        np.add.at(counts, np.asarray(r["prompt_ids"], dtype=np.int64), prompt_weight)
    # Tiny tie-break favouring low ids.
    score = counts - np.arange(vocab_size) * 1e-9
    for t in always:
        score[t] = np.inf
    head_vocab = min(head_vocab, vocab_size)
    ids = np.argpartition(-score, head_vocab - 1)[:head_vocab]
    return sorted(int(i) for i in ids)


# ----------------------------------------------------------------------------------------------- training


def _batches(records: list[dict], batch_tokens: int, rng: random.Random, shuffle: bool = True) -> list[list[dict]]:
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


def _collate(batch: list[dict], pad_id: int, lut: Any, topk: int | None = None):
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


def _kd_loss(sub_logits: Any, sub_idx: Any, t_logits: Any) -> tuple[Any, Any]:
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



def _hidden(draft: Any, ids: Any, mask: Any) -> Any:
    return draft.model(input_ids=ids, attention_mask=mask).last_hidden_state


def evaluate(draft: Any, records: list[dict], pad_id: int, lut: Any, batch_tokens: int = 4096, gamma: int = 4) -> dict[str, float]:
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
        for batch in _batches(records, batch_tokens, random.Random(0), shuffle=False):
            ids, mask, rows, cols, sub, tval, ans = _collate(batch, pad_id, lut)
            h = _hidden(draft, ids, mask)[rows, cols]
            sl = draft.lm_head.subset_logits(h)
            loss, _ = _kd_loss(sl, sub, tval)
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


def _lr_at(frac: float, peak: float, warmup_frac: float = 0.03, floor: float = 0.05) -> float:
    if frac < warmup_frac:
        return peak * max(frac / warmup_frac, 0.02)
    x = min(1.0, (frac - warmup_frac) / max(1e-9, 1 - warmup_frac))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * x)))


def front_back_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """Default initialisation: the first ceil(n/2) and the last floor(n/2) target layers.

    On SmolLM2-135M (6 of 30 layers, held-out KL to the target before training): first 3 + last 3 = 11.4
    nats, first 6 = 18.1, evenly spread = 18.0, first 5 + last = 25.3.
    """
    front = (num_layers + 1) // 2
    back = num_layers - front
    return list(range(front)) + list(range(num_target_layers - back, num_target_layers))


def _atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def distill(
    target_dir: Path,
    out_dir: Path,
    *,
    train_prompts: Path,
    num_layers: int = 6,
    head_vocab: int = 16384,
    time_budget_s: float = 3600.0,
    resume: bool = True,
    progress: bool = True,
    data_time_budget_s: float | None = None,
    generate_data: bool = True,
    max_new_tokens: int = 128,
    gen_batch_size: int = 32,
    gen_dtype: str = "bfloat16",
    heldout_frac: float = 0.03,
    lr: float = 8e-4,
    batch_tokens: int = 2048,
    topk: int = 32,
    eval_every_s: float = 300.0,
    ckpt_every_s: float = 180.0,
    reload_data_every_s: float = 300.0,
    threads: int | None = 1,
    seed: int = 0,
    export: bool = True,
    artefact_dir: Path | None = None,
    quantize_int8: bool = False,
    max_steps: int | None = None,
    init_layer_ids: list[int] | None = None,
    head_prompt_weight: float = 0.5,
) -> dict[str, Any]:
    """Distill an FR-Spec draft for ``target_dir`` into ``out_dir`` and export it as an ONNX draft.

    Stages (each resumable; ``resume=False`` restarts training from the target's layers but keeps the data):

    1. data: the target's greedy answers to ``train_prompts`` with their top-k logits
       (:func:`generate_target_data`) into ``out_dir/data``, for at most ``data_time_budget_s`` (None = the
       whole plan; another process may keep adding shards meanwhile: training reloads them every
       ``reload_data_every_s``);
    2. head vocabulary: the ``head_vocab`` most frequent target tokens (fixed at the start of training, saved
       in the checkpoint);
    3. training: top-k KL against the target on the answer positions, AdamW, cosine schedule over
       ``time_budget_s`` of training wall time (accumulated across resumes), checkpoints to
       ``out_dir/ckpt.pt`` every ``ckpt_every_s``, held-out metrics every ``eval_every_s``; stops at the budget
       (or ``max_steps``);
    4. :func:`export_checkpoint`: the head vocabulary re-chosen from all the data, the artefact
       (draft-specific tensors, fp16) to ``artefact_dir`` (default ``out_dir/artefact``), the draft rebuilt
       from target + artefact, exported to ``out_dir/onnx`` (ONNX vs PyTorch checked) and evaluated.

    Measured on SmolLM2-135M-Instruct (2 shared CPU cores, ~1/2 core for this): data ~70 answer tok/s with two
    bfloat16 workers; 6 layers + 16k head, 3000 s of training on ~180k answer tokens: held-out greedy
    agreement 0.17 (400 s), 0.26 (800 s), 0.36 (1200 s), 0.39 (2000 s).

    Returns:
        The report (also written to ``out_dir/distill_report.json``): data size, head coverage, loss curve,
        held-out agreement / simulated acceptance, artefact and ONNX paths and sizes.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models import build_distilled_draft, draft_own_state

    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = out_dir / DATA_DIR
    if threads:
        torch.set_num_threads(int(threads))
    torch.manual_seed(seed)
    report: dict[str, Any] = {
        "target_dir": str(target_dir),
        "train_prompts": str(train_prompts),
        "num_layers": num_layers,
        "head_vocab": head_vocab,
        "time_budget_s": time_budget_s,
    }

    # 1. data
    prompts = load_prompts(train_prompts)
    if generate_data:
        report["data_generation"] = generate_target_data(
            target_dir, data_dir, prompts, heldout_frac=heldout_frac, batch_size=gen_batch_size,
            max_new_tokens=max_new_tokens, topk=topk, time_budget_s=data_time_budget_s, threads=threads,
            seed=seed, gen_dtype=gen_dtype, progress=progress,
        )
    train_recs, held_recs = load_data(data_dir)
    if len(train_recs) == 0:
        raise RuntimeError(f"no training data in {data_dir} (generate some first)")
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    vocab = target.config.vocab_size

    # 2. head vocabulary + model (fresh or from the checkpoint)
    ckpt_path = out_dir / CKPT_FILE
    ckpt = None
    if resume and ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, weights_only=False)
        if ckpt["num_layers"] != num_layers or len(ckpt["head_ids"]) != min(head_vocab, vocab):
            raise ValueError(
                f"{ckpt_path} was made with num_layers={ckpt['num_layers']}, head_vocab={len(ckpt['head_ids'])}: "
                "pass the same settings or resume=False"
            )
    always = tuple(t for t in {tok.eos_token_id, pad_id, *tok.all_special_ids} if t is not None and t < vocab)
    if ckpt is not None:
        head_ids = ckpt["head_ids"]
        layer_ids = ckpt["init_layer_ids"]
    else:
        head_ids = frequent_token_ids(train_recs, vocab, head_vocab, always=always, prompt_weight=head_prompt_weight)
        layer_ids = list(init_layer_ids) if init_layer_ids is not None else front_back_layer_ids(
            target.config.num_hidden_layers, num_layers
        )
        if len(layer_ids) != num_layers:
            raise ValueError(f"init_layer_ids has {len(layer_ids)} entries, num_layers is {num_layers}")
    draft = build_distilled_draft(target, num_layers, head_ids, init_layer_ids=layer_ids)
    if ckpt is not None:
        draft.model.load_state_dict(ckpt["model"], strict=False)
    lut = torch.full((vocab,), -1, dtype=torch.long)
    lut[torch.as_tensor(head_ids)] = torch.arange(len(head_ids))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    state = {"step": 0, "train_s": 0.0, "epoch": 0, "seen_tokens": 0, "history": [], "evals": []}
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
        state = ckpt["state"]
        log.info("resumed from %s at step %d (%.0f s trained)", ckpt_path, state["step"], state["train_s"])
    report["layers_init_from"] = layer_ids
    report["train_records"] = len(train_recs)
    report["heldout_records"] = len(held_recs)

    def save_ckpt() -> None:
        _atomic_torch_save(
            {
                "num_layers": num_layers,
                "head_ids": head_ids,
                "init_layer_ids": layer_ids,
                "model": draft_own_state(draft),
                "opt": opt.state_dict(),
                "state": state,
            },
            ckpt_path,
        )

    def run_eval() -> dict[str, float]:
        te = time.perf_counter()
        m = evaluate(draft, held_recs, pad_id, lut)
        m.update(step=state["step"], train_s=round(state["train_s"], 1), eval_s=round(time.perf_counter() - te, 1))
        state["evals"].append(m)
        log.info("eval %s", m)
        draft.train()
        return m

    # 3. training
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=int(time_budget_s), initial=int(min(state["train_s"], time_budget_s)), desc="distill",
                   unit="s")
    rng = random.Random(seed + state["epoch"])
    if not state["evals"]:
        m0 = run_eval()
        if bar is not None:
            bar.set_postfix_str(f"agree {m0.get('agreement', 0):.3f}")
    draft.train()
    last_ckpt = last_eval = last_reload = time.perf_counter()
    state.setdefault("data_shards", len(list(data_dir.glob("shard_*.pt"))))
    ema = None
    stop = False
    while not stop:
        batches = _batches(train_recs, batch_tokens, rng)
        # resume inside an epoch: skip what this epoch already did
        skip = state.get("batch_in_epoch", 0) if state.get("batch_in_epoch", 0) < len(batches) else 0
        for bi in range(skip, len(batches)):
            if state["train_s"] >= time_budget_s or (max_steps is not None and state["step"] >= max_steps):
                stop = True
                break
            ts = time.perf_counter()
            ids, mask, rows, cols, sub, tval, ans = _collate(batches[bi], pad_id, lut, topk)
            for g in opt.param_groups:
                g["lr"] = _lr_at(state["train_s"] / time_budget_s, lr)
            h = _hidden(draft, ids, mask)[rows, cols]
            loss, _ = _kd_loss(draft.lm_head.subset_logits(h), sub, tval)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            dt = time.perf_counter() - ts
            state["step"] += 1
            state["train_s"] += dt
            state["batch_in_epoch"] = bi + 1
            state["seen_tokens"] += int(mask.sum())
            lv = float(loss.detach())
            ema = lv if ema is None else 0.95 * ema + 0.05 * lv
            if state["step"] % 10 == 0:
                state["history"].append({"step": state["step"], "train_s": round(state["train_s"], 1), "loss": round(ema, 4)})
            if bar is not None:
                bar.n = int(min(state["train_s"], time_budget_s))
                last = state["evals"][-1] if state["evals"] else {}
                bar.set_postfix_str(
                    f"ep {state['epoch']} step {state['step']} loss {ema:.3f} agree {last.get('agreement', 0):.3f}"
                )
                bar.refresh()
            now = time.perf_counter()
            if now - last_reload >= reload_data_every_s:
                last_reload = now
                n_files = len(list(data_dir.glob("shard_*.pt")))
                if n_files != state.get("data_shards", n_files):
                    state["data_shards"] = n_files
                    break  # new shards: start a new epoch over all the data
            if now - last_eval >= eval_every_s:
                run_eval()
                last_eval = time.perf_counter()
            if now - last_ckpt >= ckpt_every_s:
                save_ckpt()
                last_ckpt = time.perf_counter()
        if stop:
            break
        state["epoch"] += 1
        state["batch_in_epoch"] = 0
        rng = random.Random(seed + state["epoch"])
        new_train, _ = load_data(data_dir)
        if len(new_train) != len(train_recs):
            log.info("reloaded data: %d -> %d training answers", len(train_recs), len(new_train))
        train_recs = new_train
        state["data_shards"] = len(list(data_dir.glob("shard_*.pt")))
        last_reload = time.perf_counter()
    if bar is not None:
        bar.close()
    final = run_eval() if not state["evals"] or state["evals"][-1]["step"] != state["step"] else state["evals"][-1]
    save_ckpt()
    report.update(
        steps=state["step"],
        epochs=state["epoch"],
        train_s=round(state["train_s"], 1),
        seen_tokens=state["seen_tokens"],
        train_answer_tokens=sum(len(r["answer_ids"]) for r in train_recs),
        train_records=len(train_recs),
        loss_history=state["history"],
        evals=state["evals"],
        heldout=final,
    )

    # 4. artefact + export
    if export:
        report.update(
            export_checkpoint(target_dir, out_dir, artefact_dir=artefact_dir, quantize_int8=quantize_int8,
                              target=target, heldout=held_recs)
        )
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


# ----------------------------------------------------------------------------------------------- cost


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
    Runtime (:class:`edge_client.onnx_draft.OnnxDraftModel`), all with ``threads`` threads, interleaved
    round-robin in one process so that machine load affects them alike.

    Returns:
        {"target_ms": ..., "drafts": {name: {"ms": ..., "ratio": draft/target}}, ...}
    """
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from edge_client.onnx_draft import OnnxDraftModel

    torch.set_num_threads(int(threads))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 20000, past).tolist()
    with torch.no_grad():
        out = target(input_ids=torch.tensor([prefix]), use_cache=True)
    base_cache = out.past_key_values

    def target_once() -> float:
        cache = DynamicCache()
        for i, layer in enumerate(base_cache.layers):
            cache.update(layer.keys, layer.values, i)
        t = time.perf_counter()
        with torch.no_grad():
            target(input_ids=torch.tensor([[123]]), past_key_values=cache, use_cache=True,
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


def export_checkpoint(
    target_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    artefact_dir: str | os.PathLike | None = None,
    onnx_dir: str | os.PathLike | None = None,
    quantize_int8: bool = False,
    target: Any = None,
    heldout: list[dict] | None = None,
    refresh_head: bool = True,
    head_prompt_weight: float = 0.5,
) -> dict[str, Any]:
    """Artefact + ONNX draft from the training checkpoint in ``out_dir`` (also usable while training runs).

    Writes the artefact (draft-specific tensors, fp16, head ids, config) to ``artefact_dir`` (default
    ``out_dir/artefact``), rebuilds the draft from the target + artefact exactly as
    :func:`specdec.models.install_distilled_draft` does, exports it to ``onnx_dir`` (default ``out_dir/onnx``;
    ONNX vs PyTorch checked) and evaluates the rebuilt draft on the held-out answers.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models import (
        build_distilled_draft,
        export_distilled_onnx,
        load_distilled_draft,
        save_distilled_artefact,
    )

    out_dir = Path(out_dir)
    ckpt = torch.load(out_dir / CKPT_FILE, weights_only=False)
    if target is None:
        target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train, held_all = load_data(out_dir / DATA_DIR)
    if heldout is None:
        heldout = held_all
    head_ids = ckpt["head_ids"]
    if refresh_head and train:
        # The head rows are frozen target rows: the head vocabulary can be re-chosen from all the data generated
        # by now (training only used it to normalise q), which estimates token frequencies better.
        always = tuple(t for t in {pad_id, *tok.all_special_ids} if t is not None and t < target.config.vocab_size)
        head_ids = frequent_token_ids(train, target.config.vocab_size, len(head_ids), always=always,
                                      prompt_weight=head_prompt_weight)
    draft = build_distilled_draft(target, ckpt["num_layers"], head_ids, layer_state=ckpt["model"])
    st = ckpt["state"]
    last = st["evals"][-1] if st["evals"] else {}
    art = Path(artefact_dir) if artefact_dir is not None else out_dir / "artefact"
    extra = {
        "init_layer_ids": ckpt["init_layer_ids"],
        "head_refreshed_from_answers": sum(len(r["answer_ids"]) for r in train) if refresh_head else None,
        "training": {"steps": st["step"], "train_s": round(st["train_s"], 1), "seen_tokens": st["seen_tokens"],
                     "epochs": st["epoch"]},
        "heldout_at_checkpoint": {k: last.get(k) for k in ("agreement", "coverage", "sim_acceptance", "sim_tau")},
    }
    save_distilled_artefact(draft, target, art, extra=extra)
    installed = load_distilled_draft(target, art)  # what users get (fp16-rounded weights)
    installed.config._attn_implementation = "eager"
    lut = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    lut[installed.lm_head.token_ids] = torch.arange(len(installed.lm_head.token_ids))
    res: dict[str, Any] = {
        "artefact_dir": str(art),
        "artefact_bytes": sum(f.stat().st_size for f in art.iterdir() if f.is_file()),
        "heldout_installed": evaluate(installed, heldout, pad_id, lut) if heldout else {},
    }
    cfg_path = art / "draft_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["heldout_installed"] = res["heldout_installed"]
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    onnx_out = Path(onnx_dir) if onnx_dir is not None else out_dir / "onnx"
    export_distilled_onnx(installed, tok, onnx_out, quantize_int8=quantize_int8, check=True,
                          extra_report={"artefact": str(art), "source": str(target_dir)})
    res["onnx_dir"] = str(onnx_out)
    rep = json.loads((onnx_out / "specdec_export.json").read_text())
    res["onnx_max_abs_diff"] = rep.get("fp32_check", {}).get("max_abs_diff")
    res["onnx_bytes"] = rep.get("model_bytes")
    return res


def evaluate_onnx(onnx_dir: str | os.PathLike, records: list[dict], threads: int = 1, gamma: int = 4) -> dict[str, float]:
    """Held-out greedy agreement of an ONNX draft directory (teacher forcing, one sequence per run).

    Same metrics as :func:`evaluate` (``agreement``, ``sim_acceptance``, ``sim_tau``) for any ONNX draft in
    the layout of :mod:`specdec.models` (the distilled draft, its int8 variant, the int8 copy of the target).
    """
    from edge_client.onnx_draft import OnnxDraftModel

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
