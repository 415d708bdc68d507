"""The training data of ``specdec draft train-head``: the target's own greedy answers to the training prompts
(EAGLE practice: a head learns the distribution it will draft for, the target's answers, not the prompts' text),
then one feature pass per sequence: the target's hidden states at the head's layers and its argmax next token.

Generating answers is the costly part on a CPU: prompts are generated in batches of similar length (left padded),
and the answers are cached under ``~/.cache/specdec/head-data`` keyed by the target, the prompts file and the
settings, so a second training with other head settings starts at once.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["HeadSequence", "load_prompt_texts", "target_answers", "target_features", "data_cache_dir"]


@dataclass
class HeadSequence:
    """One training sequence: ``ids`` [L] (chat-templated prompt, then the target's greedy answer from
    ``answer_start``), ``features`` float16 [L - 1, k·H] (the target's hidden states at the head's layers,
    positions 0 .. L-2, concatenated), ``labels`` int64 [L] (the target's argmax next token at each position),
    ``final`` float16 [L, H] (the target's final normed state: its LM head over it gives the target's next-token
    logits, the soft labels); ``loss_start``: the first entry the training loss counts (set by the trainer)."""

    ids: list[int]
    answer_start: int
    features: object = None
    labels: object = None
    final: object = None
    loss_start: int = 0


def data_cache_dir() -> Path:
    from specdec_runtime.common.paths import default_cache_dir

    return Path(default_cache_dir()) / "head-data"


def load_prompt_texts(path: Path, limit: int) -> list[str]:
    """The first ``limit`` ``prompt`` fields of a jsonl file (blank lines skipped).

    Raises:
        ValueError: one line naming the file and line: a line that is not a JSON object with a non-empty
            string ``prompt``; a file with no prompt at all.
    """
    texts = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            prompt = record.get("prompt") if isinstance(record, dict) else None
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{path}:{lineno}: no \"prompt\" text (each line: {{\"prompt\": \"...\"}})")
            texts.append(prompt)
            if len(texts) >= limit:
                break
    if not texts:
        raise ValueError(f"{path}: no prompts (each line: {{\"prompt\": \"...\"}})")
    return texts


def _templated(tok, texts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Chat-templated prompt ids; prompts longer than ``max_prompt_tokens`` are skipped (not cut: a cut prompt
    is not a question the target would be asked)."""
    out = []
    for text in texts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
        ids = list(tok(chat, add_special_tokens=False).input_ids)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
    return out


def _generate_batch(target, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
    """Greedy answers of a batch (left padded; finished rows leave the batch: the distillation's generator,
    :func:`specdec.distill.data.greedy_batch`), each ending at its first EOS."""
    import torch

    from specdec.distill.data import greedy_batch

    width = max(len(p) for p in prompts)
    pad = 0 if eos is None else eos
    dev = target.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    return [answer for answer, _, _ in greedy_batch(target, ids, mask, max_new_tokens, -1 if eos is None else eos, 1)]


def target_answers(target, tok, target_dir, prompts_path, num_prompts: int, max_prompt_tokens: int,
                   max_new_tokens: int, batch_size: int = 16, time_budget_s: float | None = None,
                   progress: Callable[[str], None] = print) -> list[HeadSequence]:
    """The target's greedy answers to the first ``num_prompts`` prompts of ``prompts_path``, as sequences
    without features; prompts left unanswered (``time_budget_s``) follow as prompt-only sequences
    (``answer_start`` = their length). Cached per batch (see the module docstring): an interrupted or budget-cut run resumes
    where it stopped; ``time_budget_s`` stops generating (the batches done are used) once spent."""
    key = hashlib.sha256(json.dumps([str(Path(target_dir).resolve()), str(Path(prompts_path).resolve()),
                                     Path(prompts_path).stat().st_size, num_prompts, max_prompt_tokens,
                                     max_new_tokens, batch_size]).encode()).hexdigest()[:16]
    cache = data_cache_dir() / f"answers-{key}.jsonl"
    rows = [json.loads(line) for line in cache.read_text().splitlines()] if cache.is_file() else []
    prompts = sorted(_templated(tok, load_prompt_texts(Path(prompts_path), num_prompts), max_prompt_tokens), key=len)
    t0 = time.monotonic()
    cache.parent.mkdir(parents=True, exist_ok=True)
    for b in range(len(rows), len(prompts), batch_size):
        if time_budget_s is not None and time.monotonic() - t0 > time_budget_s:
            progress(f"answers: time budget spent, {len(rows)}/{len(prompts)} prompts used")
            break
        batch = prompts[b: b + batch_size]
        new = [{"ids": p + a, "answer_start": len(p)}
               for p, a in zip(batch, _generate_batch(target, batch, max_new_tokens, tok.eos_token_id))]
        with cache.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
        rows.extend(new)
        progress(f"answers: {len(rows)}/{len(prompts)} prompts ({time.monotonic() - t0:.0f} s)")
    unanswered = [HeadSequence(p, len(p)) for p in prompts[len(rows):]]  # prompt text only: cheap context data
    return [HeadSequence(r["ids"], r["answer_start"]) for r in rows] + unanswered


def target_features(target, sequences: list[HeadSequence], layers: list[int], batch_size: int = 16,
                    progress: Callable[[str], None] = print) -> list[HeadSequence]:
    """Fill ``features``, ``labels`` and ``final`` of each sequence with one forward pass of the target (no grad; right
    padded batches). Layer index i is the input of decoder layer i (0: the embeddings), num_hidden_layers the
    final normed state: the verifier's contract (:mod:`common.features`)."""
    import torch

    n = target.config.num_hidden_layers
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].ids))
    t0 = time.monotonic()
    for b in range(0, len(order), batch_size):
        batch = [sequences[i] for i in order[b: b + batch_size]]
        width = max(len(s.ids) for s in batch)
        ids = torch.tensor([s.ids + [0] * (width - len(s.ids)) for s in batch], device=target.device)
        mask = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in batch], device=target.device)
        with torch.inference_mode():
            o = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            states = list(o.hidden_states[:n]) + [o.last_hidden_state]
            labels = target.lm_head(o.last_hidden_state).argmax(-1)
            # kept in host memory (float16), whatever the target's device: the whole data set outgrows a GPU's
            feats = torch.cat([states[i] for i in layers], -1).half().cpu()
            final, labels = o.last_hidden_state.half().cpu(), labels.cpu()
        for j, s in enumerate(batch):
            length = len(s.ids)
            s.features, s.labels = feats[j, : length - 1].clone(), labels[j, :length].clone()
            s.final = final[j, :length].clone()
        if (b // batch_size) % 10 == 0 or b + batch_size >= len(order):
            progress(f"features: {min(b + batch_size, len(order))}/{len(order)} sequences "
                     f"({time.monotonic() - t0:.0f} s)")
    return sequences
