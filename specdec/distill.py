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

Everything lives in ``out_dir`` and is resumable: ``data/`` (generated shards), ``ckpt.pt`` (training
state), ``draft-hf/`` (the full HF draft), ``artefact/`` (only the draft-specific weights, fp16, for
committing), ``onnx/`` (the exported ONNX draft), ``distill_report.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

__all__ = [
    "ARTEFACT_CONFIG",
    "ARTEFACT_WEIGHTS",
    "MASKED_LOGIT",
    "FrSpecHead",
    "build_draft_from_target",
    "distill",
    "export_distilled_onnx",
    "generate_target_data",
    "install_distilled_draft",
    "load_artefact",
    "measure_costs",
    "save_artefact",
]

MASKED_LOGIT = -1.0e9  # logit of tokens outside the draft's head vocabulary (exp() underflows to exactly 0)
ARTEFACT_CONFIG = "draft_config.json"
ARTEFACT_WEIGHTS = "draft_weights.safetensors"
HEAD_IDS_KEY = "head_token_ids"
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
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
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
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    max_new_tokens=plan["max_new_tokens"],
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=pad,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            seqs = out.sequences[:, width:]
            logits = torch.stack(out.logits, dim=1)  # [B, T, V]
            top_v, top_i = logits.topk(plan["topk"], dim=-1)
            for r, (pi, ids) in enumerate(batch):
                ans = seqs[r].tolist()
                n = len(ans)
                if eos in ans:
                    n = ans.index(eos) + 1  # keep the EOS: the draft must predict the end too
                records.append(
                    {
                        "prompt_index": pi,
                        "prompt_ids": torch.tensor(ids, dtype=torch.int32),
                        "answer_ids": torch.tensor(ans[:n], dtype=torch.int32),
                        "topk_ids": top_i[r, :n].to(torch.int32).clone(),
                        "topk_logits": top_v[r, :n].to(torch.float16).clone(),
                    }
                )
                n_tokens += n
        tmp = _shard_path(data_dir, si).with_suffix(f".tmp{os.getpid()}")
        torch.save({"heldout": shard["heldout"], "records": records}, tmp)
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


def load_data(data_dir: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """(train records, held-out records) of every shard present."""
    import torch

    train, held = [], []
    for p in sorted(Path(data_dir).glob("shard_*.pt")):
        d = torch.load(p, weights_only=False)
        (held if d["heldout"] else train).extend(d["records"])
    return train, held
