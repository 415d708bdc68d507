"""``specdec draft train-head``: train an EAGLE-3 draft head for a target on its own features and next-token
distributions, with EAGLE-3's training-time test (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test"), and write it in the layout EAGLE-3's authors publish, so that
``specdec models export-head`` (:mod:`specdec.models.head_export`) converts it like any published head.

Data (:mod:`specdec.distill.head_data`): the target's own greedy answers to the training prompts (never the
benchmark prompts), chat template applied; per sequence the target runs once more (no grad) for its hidden states
at EAGLE-3's three layers (concatenated: the head's fc fuses them) and its argmax next token at every position.
The loss is the cross-entropy against that argmax on the answer's positions, on the draft vocabulary (the
``draft_vocab`` tokens most often the target's argmax on the answers; ``d2t`` maps them back; an argmax outside
it is not counted). The head starts from the target's last decoder layer, final norm and LM head rows
(:func:`specdec.distill.head_net.init_from_target`).

Training-time test: step 0 feeds entry t = (x_{t+1}, fc(f_t)) and learns p_target(x_{t+2} | x_≤t+1); step k feeds
(x_{t+1+k}, h^{k-1}_t), the head's own output of step k-1, attending to the step-0 entries 0..t and to its own
entries of steps 1..k at t, as drafting does at its k-th token; the loss of step k is weighted 0.8^k as in EAGLE-3.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from specdec.distill.head_net import TrainableHead, init_from_target

__all__ = ["CHECKPOINT_FILES", "DEFAULT_DRAFT_VOCAB", "TrainableHead", "check_checkpoint", "train_head"]

DEFAULT_DRAFT_VOCAB = 8192  # the target's most frequent answer tokens the head drafts (q = 0 outside them)
CHECKPOINT_FILES = ("model.safetensors", "config.json", "training.json")  # as _save writes them: the last one last


def _common_prefix(sequences: list[list[int]]) -> int:
    first = sequences[0] if sequences else []
    n = len(first)
    for seq in sequences[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], seq)) if a != b), min(n, len(seq)))
    return n


def _with_loss_starts(data: list, prompt_positions: bool) -> list:
    """Set each sequence's ``loss_start`` (answers: from their first token; with ``prompt_positions`` the prompt's
    own tokens too, past the chat template's fixed system turn, which teaches nothing); drop the sequences with
    nothing left to learn."""
    preamble = _common_prefix([s.ids for s in data])
    for s in data:
        s.loss_start = max(min(preamble if prompt_positions else s.answer_start, s.answer_start) - 2, 0)
    return [s for s in data if len(s.ids) - s.loss_start > 3]


def _draft_vocab(sequences, vocab_size: int, draft_vocab: int):
    """The ``draft_vocab`` target ids most often the target's argmax where the loss counts (ties: lowest id),
    sorted."""
    import torch

    counts = torch.zeros(vocab_size)
    for s in sequences:
        counts += torch.bincount(s.labels[s.loss_start + 1:], minlength=vocab_size)[:vocab_size].float()
    counts += torch.arange(vocab_size, 0, -1).float() * 1e-9  # deterministic ties
    return torch.sort(torch.topk(counts, min(draft_vocab, vocab_size)).indices).values


def _sequence_loss(head, embed, s, to_draft, theta: float, ttt_steps: int, agree, seen, lm_rows=None):
    """The TTT loss of one sequence: per step k, from entry ``s.loss_start`` on (earlier entries are context
    only), weighted 0.8^k; counts top-1 agreement with the target's argmax per step (rows whose argmax is outside
    the draft vocabulary count as misses: a head cannot draft them). With ``lm_rows`` (the target's LM head rows
    of the draft vocabulary, [draft_vocab, H]) the loss is the cross-entropy against the target's next-token
    distribution restricted to the draft vocabulary (EAGLE-3's soft labels: every position teaches the whole
    distribution, not one token); without, against the argmax (-1 outside the draft vocabulary, not counted)."""
    import torch

    dev = embed.device  # the sequence's tensors wait in host memory; the step runs where the head is
    ids = torch.tensor(s.ids, device=dev)
    outs = head.steps(embed[ids], s.features.to(dev).float(), theta, ttt_steps, first=s.loss_start)
    begin = outs[0][0] if outs else 0
    soft = None if lm_rows is None else (s.final[begin + 1:].to(dev).float() @ lm_rows.T).softmax(-1)  # [L-begin-1, V']
    labels_all = s.labels.to(dev)
    loss = 0.0
    for k, (begin, logits) in enumerate(outs):
        labels = to_draft[labels_all[begin + 1 + k: begin + 1 + k + logits.shape[0]]]
        if soft is not None:
            target = soft[k: k + logits.shape[0]]
            step_loss = -(target * logits.log_softmax(-1)).sum(-1).mean()
        elif int((labels >= 0).sum()) == 0:
            continue
        else:
            step_loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-1)
        loss = loss + 0.8 ** k * step_loss
        agree[k] += int((logits.argmax(-1) == labels).sum())
        seen[k] += logits.shape[0]
    return loss


def _heldout_agreement(head, embed, data, to_draft, theta: float, ttt_steps: int) -> list[float] | None:
    """Top-1 agreement with the target's argmax per draft position on sequences the head never trains on; None
    when none is held out."""
    import torch

    if not data:
        return None
    agree, seen = [0] * ttt_steps, [0] * ttt_steps
    with torch.no_grad():
        for s in data:
            _sequence_loss(head, embed, s, to_draft, theta, ttt_steps, agree, seen)
    return [a / max(n, 1) for a, n in zip(agree, seen)]


def _split_heldout(data, fraction: float):
    """(train, held out): floor(N × ``fraction``) of the N sequences, chosen with a fixed seed, kept apart to
    measure generalisation. None below 1/``fraction`` sequences (34 at 0.03): a handful of sequences all train,
    rather than one of them measuring agreement alone; none when ``fraction`` is 0."""
    import torch

    n = max(min(int(len(data) * fraction + 1e-9), len(data) - 1), 0)  # the epsilon: 0.29 × 100 is 28.999...
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(1234)).tolist()
    keep = set(order[n:])
    return [s for i, s in enumerate(data) if i in keep], [s for i, s in enumerate(data) if i not in keep]


def _train_epoch(head, opt, sched, data, embed, to_draft, theta, ttt_steps, epoch, lm_rows, t0, progress):
    """One pass over ``data`` in a fixed-seed order, one optimiser step per sequence: (losses, agree, seen)."""
    import torch

    losses, agree, seen = [], [0] * ttt_steps, [0] * ttt_steps
    for step, i in enumerate(torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch)).tolist()):
        loss = _sequence_loss(head, embed, data[i], to_draft, theta, ttt_steps, agree, seen, lm_rows)
        if not torch.is_tensor(loss):
            continue
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.params.values(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 100 == 99:
            progress(f"epoch {epoch + 1} step {step + 1}/{len(data)}: loss {sum(losses[-100:]) / len(losses[-100:]):.3f}"
                     f" ({time.monotonic() - t0:.0f} s)")
    return losses, agree, seen


def _vocabulary(data, vocab_size: int, start: dict | None, draft_vocab: int | None, dev):
    """(vocab_ids, to_draft): the draft vocabulary (sorted target ids, on the CPU: the checkpoint's when going
    on from one, else the data's most frequent) and the map target id → draft index (-1 outside it) [V] on
    ``dev``."""
    import torch

    vocab_ids = (start["vocab_ids"] if start is not None
                 else _draft_vocab(data, vocab_size, DEFAULT_DRAFT_VOCAB if draft_vocab is None else draft_vocab))
    to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
    to_draft[vocab_ids] = torch.arange(len(vocab_ids))
    return vocab_ids, to_draft.to(dev)


def _initial_head(target, vocab_ids, layers: list[int], start: dict | None, from_target_layer: bool) -> TrainableHead:
    """The head training starts from: the checkpoint ``start`` (:func:`_load_checkpoint`) when given, else the
    target's last layer (:func:`init_from_target`) with ``from_target_layer``, else random weights."""
    import torch

    cfg = target.config
    head = TrainableHead(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                         len(vocab_ids))
    if start is not None:
        with torch.no_grad():
            for name, p in head.params.items():
                p.copy_(start["weights"][name].float())
    elif from_target_layer:
        init_from_target(head, target, vocab_ids, layers)
    return head


def _epoch_point(epoch: int, epochs: int, losses: list, top1: list, heldout_top1: list | None, t0: float,
                 progress: Callable[[str], None]) -> dict:
    """One point of the curve, also reported on ``progress``: the epoch's mean loss, the top-1 agreement per
    draft position on the training data and on the held-out sequences (None: none held out), seconds since t0."""
    point = {"epoch": epoch + 1, "loss": sum(losses) / max(len(losses), 1), "top1_per_step": top1,
             "heldout_top1_per_step": heldout_top1, "s": time.monotonic() - t0}
    held = ("none held out" if heldout_top1 is None
            else "held out: " + ", ".join(f"{x:.3f}" for x in heldout_top1))
    progress(f"epoch {epoch + 1}/{epochs}: loss {point['loss']:.3f}, top-1 agreement per draft position "
             + ", ".join(f"{x:.3f}" for x in top1) + f" ({held}) ({point['s']:.0f} s)")
    return point


def train_head(target_dir, prompts_path, out_dir, *, num_prompts: int = 480, max_prompt_tokens: int = 160,
               max_new_tokens: int = 64, draft_vocab: int | None = None, epochs: int = 2, ttt_steps: int = 4,
               lr: float = 1e-3, init_from_target_layer: bool = True, generate_batch_size: int = 16,
               data_time_budget_s: float | None = None, prompt_positions: bool = True,
               soft_labels: bool = True, heldout_fraction: float = 0.03, init_from: str | Path | None = None,
               device: str = "auto", progress: Callable[[str], None] = print) -> dict:
    """Train an EAGLE-3 head for the HF target in ``target_dir`` on its greedy answers to the first
    ``num_prompts`` prompts of ``prompts_path`` (jsonl with a ``prompt`` field; :mod:`specdec.distill.head_data`);
    write the checkpoint (config.json, model.safetensors, training.json) into ``out_dir``; return the curve: per
    epoch the mean loss and the top-1 agreement with the target's argmax at each TTT step on the answers (a proxy
    of greedy acceptance at draft position k + 1), and the seconds it took. ``data_time_budget_s`` caps the
    answers' generation (the cached batches are used; the prompts left unanswered count as prompt-only
    sequences); ``prompt_positions``: learn the target's argmax on the prompt's tokens too (past the chat
    template's fixed preamble), not only on the answers; ``soft_labels``: learn the target's whole next-token
    distribution on the draft vocabulary (EAGLE-3), not its argmax; ``heldout_fraction``: sequences kept out of
    training, on which each epoch's agreement is measured too (``heldout_top1_per_step``; None when none is held
    out, :func:`_split_heldout`); ``init_from``: a checkpoint this function wrote for the same target, to go on
    training (its weights and draft vocabulary); ``draft_vocab``: the draft vocabulary's size (None: 8192, or the
    checkpoint's with ``init_from``); ``device``: where the target answers and the head trains (``auto``: CUDA
    when there is a GPU, else the CPU; ``cpu``, ``cuda``, ``cuda:N``): the sequences' features wait in host
    memory (float16) and go to the device one sequence at a time, so the data set is not bounded by the GPU's.

    Raises:
        ValueError: one line: ``init_from`` is no checkpoint of this function, or its draft vocabulary is not
            ``draft_vocab``; a checkpoint for another vocabulary size; no training data; an unknown ``device``
            or CUDA asked for where there is none."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.distill.head_data import target_answers, target_features
    from specdec.models.head_export import embedding_sha256
    from specdec_runtime.cloud_verifier.target.runner import resolve_device

    check_checkpoint(init_from, draft_vocab)  # before the costly data, not after it
    dev = resolve_device(device)
    t0 = time.monotonic()
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval().to(dev)
    progress(f"device: {dev}")
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    cfg = target.config
    n = cfg.num_hidden_layers
    layers = [min(2, n), n // 2, max(n - 3, 0)]  # the inputs of those layers: specdec.models.head_export's
    data = target_answers(target, tok, target_dir, prompts_path, num_prompts, max_prompt_tokens, max_new_tokens,
                          generate_batch_size, data_time_budget_s, progress)
    if not prompt_positions:  # prompts left unanswered teach nothing then: no feature pass for them
        data = [s for s in data if len(s.ids) > s.answer_start]
    data = _with_loss_starts(target_features(target, data, layers, progress=progress), prompt_positions)
    vocab_size = target.get_input_embeddings().weight.shape[0]
    start = _load_checkpoint(Path(init_from), vocab_size) if init_from is not None else None
    vocab_ids, to_draft = _vocabulary(data, vocab_size, start, draft_vocab, dev)
    answer_tokens, loss_tokens = (sum(len(s.ids) - s.answer_start for s in data),
                                  sum(len(s.ids) - 1 - s.loss_start for s in data))
    progress(f"data: {len(data)} sequences, {answer_tokens} answer tokens, {loss_tokens} trained positions, "
             f"{time.monotonic() - t0:.0f} s")
    if loss_tokens <= 0:
        raise ValueError("no training data: no prompt gave a position to learn (more --num-prompts, "
                         "--max-prompt-tokens or --data-time-budget)")
    theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 1e4)))
    head = _initial_head(target, vocab_ids, layers, start, init_from_target_layer).to(dev)
    embed = target.get_input_embeddings().weight.detach().half().float()  # as the device's graph stores it
    lm_rows = target.lm_head.weight.detach().float()[vocab_ids.to(dev)] if soft_labels else None
    data, heldout = _split_heldout(data, heldout_fraction)
    opt = torch.optim.AdamW(head.params.values(), lr=lr, weight_decay=0.0)
    total = max(epochs * len(data), 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 50) * max(0.05, 1 - i / total))
    curve = []
    for epoch in range(epochs):
        losses, agree, seen = _train_epoch(head, opt, sched, data, embed, to_draft, theta, ttt_steps, epoch,
                                           lm_rows, t0, progress)
        held = _heldout_agreement(head, embed, heldout, to_draft, theta, ttt_steps)
        curve.append(_epoch_point(epoch, epochs, losses, [a / max(n, 1) for a, n in zip(agree, seen)], held, t0,
                                  progress))
    _save(head, vocab_ids, vocab_size, cfg, theta, Path(out_dir), {"curve": curve, "prompts": str(prompts_path),
          "sequences": len(data), "heldout_sequences": len(heldout), "soft_labels": soft_labels,
          "answer_tokens": answer_tokens,
          "trained_positions": loss_tokens, "seconds": time.monotonic() - t0},
          embedding_sha256(target.get_input_embeddings().weight))
    return {"curve": curve, "seconds": time.monotonic() - t0}


def check_checkpoint(ckpt: str | Path | None, draft_vocab: int | None = None) -> int | None:
    """The draft vocabulary's size of ``ckpt`` (None without one), read without loading its weights.

    Raises:
        ValueError: one line: ``ckpt`` holds no checkpoint :func:`train_head` wrote (an EAGLE-3 head's
            model.safetensors with its ``t2d``), or ``draft_vocab`` (None: any) is not its draft vocabulary's size.
    """
    from safetensors import safe_open

    if ckpt is None:
        return None
    path = Path(ckpt) / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"--init-from: no model.safetensors in {ckpt} (a directory `specdec draft train-head` wrote)")
    try:
        with safe_open(str(path), "pt") as st:
            names = set(st.keys())
            size = int(st.get_tensor("t2d").sum()) if "t2d" in names else None
    except Exception as e:  # a damaged or foreign file: safetensors raises its own error types
        raise ValueError(f"--init-from: {path} is not a safetensors file ({e})") from e
    missing = {"t2d", "fc.weight", "midlayer.self_attn.q_proj.weight"} - names
    if missing:
        raise ValueError(f"--init-from: {ckpt} is not a draft head checkpoint (no {', '.join(sorted(missing))})")
    if draft_vocab is not None and draft_vocab != size:
        raise ValueError(f"--draft-vocab {draft_vocab} disagrees with --init-from {ckpt}, whose draft vocabulary is "
                         f"{size} tokens: leave --draft-vocab out (or give {size})")
    return size


def _load_checkpoint(ckpt: Path, vocab_size: int) -> dict:
    """The weights (name → tensor) and the draft vocabulary (sorted target ids) of a checkpoint :func:`_save`
    wrote.

    Raises:
        ValueError: no such checkpoint, or one for a target with another vocabulary size.
    """
    import torch
    from safetensors.torch import load_file

    check_checkpoint(ckpt)
    weights = load_file(str(ckpt / "model.safetensors"))
    if weights["t2d"].shape[0] != vocab_size:
        raise ValueError(f"--init-from: {ckpt} is for a vocabulary of {weights['t2d'].shape[0]}, not {vocab_size}")
    vocab_ids = torch.nonzero(weights["t2d"]).flatten()
    return {"weights": weights, "vocab_ids": vocab_ids}


def _save(head: TrainableHead, vocab_ids, vocab_size: int, cfg, theta: float, out_dir: Path, report: dict,
          embedding_sha: str | None = None) -> None:
    """The checkpoint in EAGLE-3's published layout (float16 weights; ``target_embedding_sha256`` in its config
    for :func:`specdec.models.head_install.install_head`'s check), and training.json."""
    import torch
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().half().cpu().contiguous() for k, v in head.params.items()}
    weights["d2t"] = vocab_ids - torch.arange(len(vocab_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[vocab_ids] = True
    weights["t2d"] = t2d
    weights_file, config_file, report_file = CHECKPOINT_FILES
    save_file(weights, str(out_dir / weights_file))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": cfg.hidden_size,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "intermediate_size": cfg.intermediate_size, "vocab_size": vocab_size, "draft_vocab_size": len(vocab_ids),
              "rms_norm_eps": 1e-6, "rope_theta": theta, "max_position_embeddings": cfg.max_position_embeddings,
              "num_hidden_layers": 1, "target_embedding_sha256": embedding_sha}
    (out_dir / config_file).write_text(json.dumps(config, indent=1))
    (out_dir / report_file).write_text(json.dumps(report, indent=1))  # last: the checkpoint is complete
