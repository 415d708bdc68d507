"""Training of a distilled draft: the draft and its optimiser (fresh from the target's layers or from the
checkpoint), the training loop (time budget, epochs over data that may grow meanwhile, held-out evals,
checkpoints), and :func:`distill`, the whole run.

Measured on SmolLM2-135M-Instruct (2 shared CPU cores, ~1/2 core for this): data ~70 answer tok/s with two
bfloat16 workers; 6 layers + 16k head, 3000 s of training on ~180k answer tokens: held-out greedy agreement 0.17
(400 s), 0.26 (800 s), 0.36 (1200 s), 0.39 (2000 s)."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any

from specdec.bench.prompts import load_prompts
from specdec.distill.batching import length_batches, collate, draft_hidden_states, kd_loss
from specdec.distill.data import DATA_DIR, frequent_token_ids, generate_target_data, load_data
from specdec.distill.export import CKPT_FILE, export_checkpoint
from specdec.distill.metrics import evaluate

log = logging.getLogger(__name__)

REPORT_FILE = "distill_report.json"


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


def _load_checkpoint(ckpt_path: Path, num_layers: int, head_vocab: int, vocab: int) -> dict:
    import torch

    ckpt = torch.load(ckpt_path, weights_only=False)
    if ckpt["num_layers"] != num_layers or len(ckpt["head_ids"]) != min(head_vocab, vocab):
        raise ValueError(
            f"{ckpt_path} was made with num_layers={ckpt['num_layers']}, head_vocab={len(ckpt['head_ids'])}: "
            "pass the same settings or resume=False"
        )
    return ckpt


class _Trainer:
    """One run's draft, optimiser and progress (``state``: step, train seconds, epoch, loss history, evals),
    fresh from the target's layers or resumed from ``ckpt_path``; saves checkpoints and runs held-out evals."""

    def __init__(self, target: Any, tok: Any, train_recs: list[dict], held_recs: list[dict], ckpt_path: Path, *,
                 num_layers: int, head_vocab: int, resume: bool, lr: float, init_layer_ids: list[int] | None,
                 head_prompt_weight: float):
        import torch

        from specdec.models import build_distilled_draft

        vocab = target.config.vocab_size
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.held_recs, self.ckpt_path, self.num_layers = held_recs, ckpt_path, num_layers
        ckpt = _load_checkpoint(ckpt_path, num_layers, head_vocab, vocab) if resume and ckpt_path.is_file() else None
        always = tuple(t for t in {tok.eos_token_id, self.pad_id, *tok.all_special_ids} if t is not None and t < vocab)
        if ckpt is not None:
            self.head_ids = ckpt["head_ids"]
            self.layer_ids = ckpt["init_layer_ids"]
        else:
            self.head_ids = frequent_token_ids(train_recs, vocab, head_vocab, always=always,
                                               prompt_weight=head_prompt_weight)
            self.layer_ids = list(init_layer_ids) if init_layer_ids is not None else front_back_layer_ids(
                target.config.num_hidden_layers, num_layers
            )
            if len(self.layer_ids) != num_layers:
                raise ValueError(f"init_layer_ids has {len(self.layer_ids)} entries, num_layers is {num_layers}")
        self.draft = build_distilled_draft(target, num_layers, self.head_ids, init_layer_ids=self.layer_ids)
        if ckpt is not None:
            self.draft.model.load_state_dict(ckpt["model"], strict=False)
        self.lut = torch.full((vocab,), -1, dtype=torch.long)
        self.lut[torch.as_tensor(self.head_ids)] = torch.arange(len(self.head_ids))
        self.params = [p for p in self.draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
        self.state = {"step": 0, "train_s": 0.0, "epoch": 0, "seen_tokens": 0, "history": [], "evals": []}
        if ckpt is not None:
            self.opt.load_state_dict(ckpt["opt"])
            self.state = ckpt["state"]
            log.info("resumed from %s at step %d (%.0f s trained)", ckpt_path, self.state["step"],
                     self.state["train_s"])
        self.bar = None
        self.ema = None
        self.max_steps: int | None = None

    def save_ckpt(self) -> None:
        from specdec.models import draft_own_state

        _atomic_torch_save(
            {
                "num_layers": self.num_layers,
                "head_ids": self.head_ids,
                "init_layer_ids": self.layer_ids,
                "model": draft_own_state(self.draft),
                "opt": self.opt.state_dict(),
                "state": self.state,
            },
            self.ckpt_path,
        )

    def run_eval(self) -> dict[str, float]:
        te = time.perf_counter()
        m = evaluate(self.draft, self.held_recs, self.pad_id, self.lut)
        m.update(step=self.state["step"], train_s=round(self.state["train_s"], 1),
                 eval_s=round(time.perf_counter() - te, 1))
        self.state["evals"].append(m)
        log.info("eval %s", m)
        self.draft.train()
        return m

    def final_eval(self) -> dict[str, float]:
        """The held-out metrics at the current step (the last eval when it was at this step)."""
        evals = self.state["evals"]
        return self.run_eval() if not evals or evals[-1]["step"] != self.state["step"] else evals[-1]

    def step(self, batch: list[dict], *, topk: int, lr: float, time_budget_s: float) -> None:
        """One optimiser step on ``batch`` (learning rate from the share of the time budget spent)."""
        import torch

        state = self.state
        ts = time.perf_counter()
        ids, mask, rows, cols, sub, tval, ans = collate(batch, self.pad_id, self.lut, topk)
        # The schedule follows the step count when one is set (the same run on any machine), else the clock.
        frac = state["train_s"] / time_budget_s
        if self.max_steps:
            frac = max(frac, state["step"] / self.max_steps)
        for g in self.opt.param_groups:
            g["lr"] = _lr_at(frac, lr)
        h = draft_hidden_states(self.draft, ids, mask)[rows, cols]
        loss, _ = kd_loss(self.draft.lm_head.subset_logits(h), sub, tval)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        state["step"] += 1
        state["train_s"] += time.perf_counter() - ts
        state["seen_tokens"] += int(mask.sum())
        lv = float(loss.detach())
        self.ema = lv if self.ema is None else 0.95 * self.ema + 0.05 * lv
        if state["step"] % 10 == 0:
            state["history"].append({"step": state["step"], "train_s": round(state["train_s"], 1),
                                     "loss": round(self.ema, 4)})
        if self.bar is not None:
            self.bar.n = int(min(state["train_s"], time_budget_s))
            last = state["evals"][-1] if state["evals"] else {}
            self.bar.set_postfix_str(
                f"ep {state['epoch']} step {state['step']} loss {self.ema:.3f} agree {last.get('agreement', 0):.3f}"
            )
            self.bar.refresh()

    def train(self, data_dir: Path, train_recs: list[dict], *, time_budget_s: float, max_steps: int | None,
              batch_tokens: int, topk: int, lr: float, seed: int, eval_every_s: float, ckpt_every_s: float,
              reload_data_every_s: float, progress: bool) -> list[dict]:
        """Train until the time budget (or ``max_steps``); epochs reload the data (new shards start a new epoch
        early). Returns the training records of the last epoch."""
        state = self.state
        self.max_steps = max_steps
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=int(time_budget_s), initial=int(min(state["train_s"], time_budget_s)),
                            desc="distill", unit="s")
        rng = random.Random(seed + state["epoch"])
        if not state["evals"]:
            m0 = self.run_eval()
            if self.bar is not None:
                self.bar.set_postfix_str(f"agree {m0.get('agreement', 0):.3f}")
        self.draft.train()
        self.last_ckpt = self.last_eval = self.last_reload = time.perf_counter()
        state.setdefault("data_shards", len(list(data_dir.glob("shard_*.pt"))))
        while not self._epoch(length_batches(train_recs, batch_tokens, rng), data_dir, time_budget_s=time_budget_s,
                              max_steps=max_steps, topk=topk, lr=lr, eval_every_s=eval_every_s,
                              ckpt_every_s=ckpt_every_s, reload_data_every_s=reload_data_every_s):
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
            rng = random.Random(seed + state["epoch"])
            new_train, _ = load_data(data_dir)
            if len(new_train) != len(train_recs):
                log.info("reloaded data: %d -> %d training answers", len(train_recs), len(new_train))
            train_recs = new_train
            state["data_shards"] = len(list(data_dir.glob("shard_*.pt")))
            self.last_reload = time.perf_counter()
        if self.bar is not None:
            self.bar.close()
        return train_recs

    def _epoch(self, batches: list[list[dict]], data_dir: Path, *, time_budget_s: float, max_steps: int | None,
               topk: int, lr: float, eval_every_s: float, ckpt_every_s: float, reload_data_every_s: float) -> bool:
        """Steps over ``batches`` (from where a resumed epoch stopped); True when training is over, False at the
        end of the epoch or when new shards appeared."""
        state = self.state
        # resume inside an epoch: skip what this epoch already did
        skip = state.get("batch_in_epoch", 0) if state.get("batch_in_epoch", 0) < len(batches) else 0
        for bi in range(skip, len(batches)):
            if state["train_s"] >= time_budget_s or (max_steps is not None and state["step"] >= max_steps):
                return True
            self.step(batches[bi], topk=topk, lr=lr, time_budget_s=time_budget_s)
            state["batch_in_epoch"] = bi + 1
            now = time.perf_counter()
            if now - self.last_reload >= reload_data_every_s:
                self.last_reload = now
                n_files = len(list(data_dir.glob("shard_*.pt")))
                if n_files != state.get("data_shards", n_files):
                    state["data_shards"] = n_files
                    return False  # new shards: start a new epoch over all the data
            if now - self.last_eval >= eval_every_s:
                self.run_eval()
                self.last_eval = time.perf_counter()
            if now - self.last_ckpt >= ckpt_every_s:
                self.save_ckpt()
                self.last_ckpt = time.perf_counter()
        return False


def _frozen_target(target_dir: Path) -> Any:
    """The float32 target, no gradients: its embedding, LM head rows and layers initialise the draft."""
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def _training_report(state: dict, train_recs: list[dict], final: dict[str, float]) -> dict[str, Any]:
    return dict(
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


def distill(
    target_dir: Path, out_dir: Path, *, train_prompts: Path, num_layers: int = 6, head_vocab: int = 16384,
    time_budget_s: float = 3600.0, resume: bool = True, progress: bool = True, data_time_budget_s: float | None = None,
    generate_data: bool = True, max_new_tokens: int = 128, gen_batch_size: int = 32, gen_dtype: str = "bfloat16",
    heldout_frac: float = 0.03, lr: float = 8e-4, batch_tokens: int = 2048, topk: int = 32,
    eval_every_s: float = 300.0, ckpt_every_s: float = 180.0, reload_data_every_s: float = 300.0,
    threads: int | None = 1, seed: int = 0, export: bool = True, artefact_dir: Path | None = None,
    quantize_int8: bool = False, max_steps: int | None = None, init_layer_ids: list[int] | None = None,
    head_prompt_weight: float = 0.5, data_max_shards: int | None = None, max_prompt_tokens: int = 320,
) -> dict[str, Any]:
    """Distill an FR-Spec draft for ``target_dir`` into ``out_dir`` and export it as an ONNX draft.

    Stages (each resumable; ``resume=False`` restarts training from the target's layers but keeps the data):

    1. data: the target's greedy answers to ``train_prompts`` with their top-k logits
       (:func:`generate_target_data`) into ``out_dir/data``, for at most ``data_time_budget_s`` (None = the
       whole plan; another process may keep adding shards meanwhile: training reloads them every
       ``reload_data_every_s``), or the first ``data_max_shards`` shards of the seeded plan (held-out first),
       prompts of at most ``max_prompt_tokens`` tokens;
    2. head vocabulary: the ``head_vocab`` most frequent target tokens (fixed at the start of training, saved
       in the checkpoint);
    3. training: top-k KL against the target on the answer positions, AdamW, cosine schedule over
       ``time_budget_s`` of training wall time (accumulated across resumes), checkpoints to
       ``out_dir/ckpt.pt`` every ``ckpt_every_s``, held-out metrics every ``eval_every_s``; stops at the budget
       (or ``max_steps``; with ``max_steps`` the schedule runs over the steps, so a seeded run is the same
       run on any machine unless the time budget cuts it first);
    4. :func:`export_checkpoint`: the head vocabulary re-chosen from all the data, the artefact
       (draft-specific tensors, fp16) to ``artefact_dir`` (default ``out_dir/artefact``), the draft rebuilt
       from target + artefact, exported to ``out_dir/onnx`` (ONNX vs PyTorch checked) and evaluated.

    Returns:
        The report (also written to ``out_dir/distill_report.json``): data size, head coverage, loss curve,
        held-out agreement / simulated acceptance, artefact and ONNX paths and sizes.
    """
    import torch
    from transformers import AutoTokenizer

    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = out_dir / DATA_DIR
    if threads:
        torch.set_num_threads(int(threads))
    torch.manual_seed(seed)
    report: dict[str, Any] = {"target_dir": str(target_dir), "train_prompts": str(train_prompts),
                              "num_layers": num_layers, "head_vocab": head_vocab, "time_budget_s": time_budget_s}
    # 1. data
    if generate_data:
        report["data_generation"] = generate_target_data(
            target_dir, data_dir, [q.prompt for q in load_prompts(train_prompts)], heldout_frac=heldout_frac,
            batch_size=gen_batch_size, max_new_tokens=max_new_tokens, topk=topk, time_budget_s=data_time_budget_s,
            threads=threads, seed=seed, gen_dtype=gen_dtype, progress=progress, max_shards=data_max_shards,
            max_prompt_tokens=max_prompt_tokens,
        )
    train_recs, held_recs = load_data(data_dir)
    if len(train_recs) == 0:
        raise RuntimeError(f"no training data in {data_dir} (generate some first)")
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = _frozen_target(target_dir)
    # 2. head vocabulary + model (fresh or from the checkpoint)
    trainer = _Trainer(target, tok, train_recs, held_recs, out_dir / CKPT_FILE, num_layers=num_layers,
                       head_vocab=head_vocab, resume=resume, lr=lr, init_layer_ids=init_layer_ids,
                       head_prompt_weight=head_prompt_weight)
    report.update(layers_init_from=trainer.layer_ids, train_records=len(train_recs), heldout_records=len(held_recs))
    # 3. training
    train_recs = trainer.train(
        data_dir, train_recs, time_budget_s=time_budget_s, max_steps=max_steps, batch_tokens=batch_tokens, topk=topk,
        lr=lr, seed=seed, eval_every_s=eval_every_s, ckpt_every_s=ckpt_every_s,
        reload_data_every_s=reload_data_every_s, progress=progress)
    final = trainer.final_eval()
    trainer.save_ckpt()
    report.update(_training_report(trainer.state, train_recs, final))
    # 4. artefact + export
    if export:
        report.update(export_checkpoint(target_dir, out_dir, artefact_dir=artefact_dir, quantize_int8=quantize_int8,
                                        target=target, heldout=held_recs))
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report
