"""Target data of a distillation run: the shard plan, the target's greedy answers with their top-k logits
(shards), loading them back, and the head vocabulary they determine (FR-Spec)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DATA_DIR = "data"


def is_heldout(prompt: str, heldout_frac: float) -> bool:
    """Deterministic held-out split by a hash of the prompt text."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
    return (h % 100_000) < heldout_frac * 100_000


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
    from transformers import AutoTokenizer

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(int(threads))
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    plan = _load_or_make_plan(
        data_dir / "plan.json", prompts, heldout_frac=heldout_frac, max_heldout=max_heldout, batch_size=batch_size,
        chunk_batches=chunk_batches, max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, topk=topk,
        seed=seed)
    model32, model_gen = _load_generators(target_dir, gen_dtype)
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
    for si in todo:
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
        shard = plan["shards"][si]
        model = model32 if shard["heldout"] else model_gen
        ts = time.perf_counter()
        records = _generate_shard(model, tok, prompts, shard["prompts"], plan)
        n_tokens += sum(len(r["answer_ids"]) for r in records)
        tmp = _shard_path(data_dir, si).with_suffix(f".tmp{os.getpid()}")
        torch.save({"heldout": shard["heldout"], "dtype": str(model.dtype), "records": records}, tmp)
        os.replace(tmp, _shard_path(data_dir, si))
        rate = sum(len(r["answer_ids"]) for r in records) / max(time.perf_counter() - ts, 1e-9)
        log.info("shard %d: %d answers, %.1f answer tok/s", si, len(records), rate)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{n_tokens} tok, {n_tokens / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
    if bar is not None:
        bar.close()
    total = sum(1 for i in range(len(plan["shards"])) if _shard_path(data_dir, i).is_file())
    return {"shards_done": total, "shards_planned": len(plan["shards"]), "new_tokens": n_tokens,
            "seconds": time.perf_counter() - t0}


def _load_or_make_plan(plan_path: Path, prompts: list[str], *, heldout_frac: float, max_heldout: int,
                       batch_size: int, chunk_batches: int, max_new_tokens: int, max_prompt_tokens: int, topk: int,
                       seed: int) -> dict[str, Any]:
    """The plan saved at ``plan_path``, or a new one (saved there): which prompts go to which shard, held-out
    shards first, and the generation settings."""
    if plan_path.is_file():
        return json.loads(plan_path.read_text())
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
    return plan


def _load_generators(target_dir: str | os.PathLike, gen_dtype: str) -> tuple[Any, Any]:
    """(float32 target, target in ``gen_dtype``) — the same model when ``gen_dtype`` is float32.

    Held-out answers always come from the float32 target (honest metric); training answers from
    ``gen_dtype`` (bfloat16 is ~2x faster on CPUs with AVX512-BF16; its top-k logits are a close soft
    teacher, its greedy answers ~on-policy)."""
    import torch
    from transformers import AutoModelForCausalLM

    model32 = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    if gen_dtype == "float32":
        return model32, model32
    return model32, AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=getattr(torch, gen_dtype)).eval()


def _generate_shard(model: Any, tok: Any, prompts: list[str], prompt_indices: list[int], plan: dict) -> list[dict]:
    """The records of one shard: each prompt's ids (as the edge encodes them), the model's greedy answer and its
    top-k logits per answer position; prompts longer than the plan's ``max_prompt_tokens`` are left out."""
    import torch

    from specdec_runtime.edge_client.client import encode_prompt

    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    encs = []
    for pi in prompt_indices:
        ids = encode_prompt(tok, prompts[pi])
        if len(ids) <= plan["max_prompt_tokens"]:
            encs.append((pi, ids))
    encs.sort(key=lambda e: len(e[1]))
    records = []
    bs = plan["batch_size"]
    for b in range(0, len(encs), bs):
        batch = encs[b : b + bs]
        width = max(len(e[1]) for e in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, (_, ids) in enumerate(batch):
            input_ids[r, width - len(ids) :] = torch.tensor(ids)
            mask[r, width - len(ids) :] = 1
        for (pi, ids), (ans, ti, tv) in zip(
            batch, greedy_batch(model, input_ids, mask, plan["max_new_tokens"], eos, plan["topk"])
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
    return records


def greedy_batch(model: Any, input_ids: Any, mask: Any, max_new_tokens: int, eos: int, topk: int) -> list:
    """Greedy answers of a left-padded batch with the target's top-k logits at each answer position
    (``input_ids``, ``mask``: [batch, prompt_len] long, left-padded; ``eos``: -1 for none).

    Finished rows (EOS emitted) leave the batch at once (their KV-cache rows are dropped), so no compute is
    spent on padding after an answer ends. Returns per row (answer ids incl. EOS, topk ids [n, k] long,
    topk logits [n, k] float32).
    """
    import torch
    from transformers import DynamicCache

    b, dev = input_ids.shape[0], input_ids.device
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
            out = model(input_ids=cur, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                        logits_to_keep=1)
            logits = out.logits[:, -1].float()
            v, i = logits.topk(topk, dim=-1)
            nxt = i[:, 0]
            keep = []
            for r, (row, token) in enumerate(zip(alive.tolist(), nxt.tolist())):  # one device sync per step
                answers[row].append(token)
                tids[row].append(i[r])
                tvals[row].append(v[r])
                if token != eos:
                    keep.append(r)
            if not keep or step + 1 == max_new_tokens:
                break
            if len(keep) < len(alive):
                idx = torch.tensor(keep, device=dev)
                for layer in cache.layers:
                    layer.keys = layer.keys.index_select(0, idx)
                    layer.values = layer.values.index_select(0, idx)
                alive, nxt, mask, pos = alive[idx.cpu()], nxt[idx], mask[idx], pos[idx]
            mask = torch.cat([mask, torch.ones(len(alive), 1, dtype=mask.dtype, device=dev)], dim=1)
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
