"""Distillation of a cheap draft model for a target (``specdec draft distill``).

Recipe (DistillSpec, Zhou et al. 2024; FR-Spec, Zhao et al. 2025):

- **Architecture.** A ``LlamaForCausalLM`` with the target's hidden size and ``num_layers`` decoder layers
  initialised from target layers spread over its depth. It reuses the target's (tied) embedding matrix,
  frozen, and drafts only over the ``head_vocab`` tokens most frequent in target-generated text: its LM head
  is the target's LM head restricted to those rows (frozen), followed by a scatter into a full-vocabulary
  logits row that is ``-inf`` (a very negative number, :data:`MASKED_LOGIT`) elsewhere. The draft's q is
  therefore zero outside its vocabulary and rejection sampling stays exact. The trained tensors are the
  layers and the final norm only.
- **Data (on-policy).** The target's own greedy answers (prompts encoded as the edge encodes them,
  :func:`edge_client.client.encode_prompt`; at most ``max_new_tokens``) to the train prompts, generated in
  PyTorch in left-padded batches; each answer position stores the target's top-k logits (from the generation
  itself: no second target pass during training). Held-out prompts (a fixed
  hash-based fraction of the train prompts) are generated first and never trained on.
- **Loss.** Top-k forward KL: cross-entropy of the draft's log-softmax (over its head vocabulary) against the
  target's softmax over its stored top-k logits (renormalised, restricted to the head vocabulary), on the
  answer positions only. Held-out metric: greedy top-1 agreement of the draft with the target on the held-out
  answers (teacher forcing), which is the greedy per-token acceptance probability.

Everything lives in ``out_dir`` and is resumable: ``data/`` (generated shards + their plan), ``ckpt.pt``
(training state), ``artefact/`` (only the draft-specific weights, fp16, for committing), ``onnx/`` (the
exported ONNX draft), ``distill_report.json``. Data generation can also run in separate processes
(:func:`generate_target_data` with ``worker``/``num_workers``) while training reloads new shards.

Modules: :mod:`.data` (plan, target answers, shards, head vocabulary), :mod:`.batching` (batches, collation,
loss), :mod:`.training` (the draft's training and :func:`distill`), :mod:`.metrics` (held-out agreement,
simulated speculation, costs), :mod:`.export` (artefact and ONNX draft from the checkpoint). The training
prompts are read by :func:`specdec.bench.prompts.load_prompts` (a ``prompt`` field per line).
"""

from __future__ import annotations

from specdec.models import (  # re-exported: the install path lives with the model registry
    DISTILLED_MASKED_LOGIT as MASKED_LOGIT,
    install_distilled_draft,
)
from specdec.distill.data import DATA_DIR, frequent_token_ids, generate_target_data, is_heldout, load_data
from specdec.distill.export import CKPT_FILE, export_checkpoint
from specdec.distill.metrics import evaluate, evaluate_onnx, measure_costs, replay_greedy_blocks
from specdec.distill.training import REPORT_FILE, distill, front_back_layer_ids

__all__ = [
    "CKPT_FILE",
    "DATA_DIR",
    "MASKED_LOGIT",
    "REPORT_FILE",
    "distill",
    "evaluate",
    "evaluate_onnx",
    "export_checkpoint",
    "frequent_token_ids",
    "front_back_layer_ids",
    "generate_target_data",
    "install_distilled_draft",
    "is_heldout",
    "load_data",
    "measure_costs",
    "replay_greedy_blocks",
]
