"""Ragged attention kernels of the target runner, registered with HF transformers' ``AttentionInterface``.

All rows of a batch (draft blocks of different sessions, prefill chunks) are flattened into one sequence of
T tokens by :class:`cloud_verifier.target.TargetRunner`; projections and MLPs run over it as one matmul. Only
attention is per row: each row writes its new keys/values into its own session's KV cache and attends,
causally, to that cache. :func:`ragged_attention` is that attention function, registered under the name
``ATTN_IMPLEMENTATION`` so that any HF causal LM whose attention layers use the interface (Llama, Mistral,
Qwen2/3, Phi-3, Gemma 2/3, Granite, SmolLM, ...) runs it, sliding windows and score soft-capping included.
Padding never exists, so it cannot leak into a row's result.

Two paths per row: a prefill chunk (more than ``SMALL_ROW_TOKENS`` tokens) takes one multi-threaded SDPA call;
draft blocks and decode steps (many tiny problems) take :func:`small_attention`, two ``bmm`` calls on the
calling thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from cloud_verifier.target import SessionKV

ATTN_IMPLEMENTATION = "specdec_ragged"
SMALL_ROW_TOKENS = 32  # rows up to this many tokens take the single-threaded small-attention path


@dataclass
class RaggedBatch:
    """The rows of one forward pass, passed to every attention layer as the ``specdec_batch`` argument."""

    # (kv, first token index in the flat batch, end index, start position) per row
    rows: list[tuple[SessionKV, int, int, int]] = field(default_factory=list)


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_heads, T, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, T, head_dim] (RoPE applied)
    value: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    specdec_batch: RaggedBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, T, num_heads, head_dim], None)
    """Per-row causal attention over each row's own KV cache (writes the new keys/values into it).

    ``sliding_window`` (Mistral, Qwen2, Phi-3, Gemma's local layers; None = full attention): a query at position
    i sees keys at positions i - sliding_window < j <= i, HF's convention. The whole cache is kept (rolling back
    stays free); only the window's keys are read. ``softcap`` (Gemma 2): scores become softcap * tanh(s / softcap)
    before the softmax. HF's ``attention_mask`` is ignored: rows never see each other, and no row is padded.

    Raises:
        RuntimeError: called without ``specdec_batch`` (the model was not run by the target runner).
    """
    if specdec_batch is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the specdec_batch argument")
    layer = module.layer_idx
    window = int(sliding_window) if sliding_window else None
    num_tokens = query.shape[2]
    out = query.new_empty(1, num_tokens, query.shape[1], query.shape[3])
    small = []
    for row in specdec_batch.rows:
        kv, begin, end, start = row
        n = end - begin
        keys = kv.buffer[layer, 0]  # [num_kv_heads, capacity, head_dim]
        values = kv.buffer[layer, 1]
        keys[:, start : start + n] = key[0, :, begin:end]
        values[:, start : start + n] = value[0, :, begin:end]
        if n > SMALL_ROW_TOKENS and softcap is None:  # prefill chunk: one multi-threaded SDPA call pays off
            q = query[0, :, begin:end]  # [num_heads, n, head_dim]
            lo = _first_key(start, window)
            mask = None if start == 0 and window is None else _allowed(start, n, lo, window, q.device)
            o = F.scaled_dot_product_attention(
                q, keys[:, lo : start + n], values[:, lo : start + n], attn_mask=mask, is_causal=mask is None,
                scale=scaling, enable_gqa=True,
            )  # [num_heads, n, head_dim]
            out[0, begin:end] = o.transpose(0, 1)
        else:
            small.append(row)
    if small:
        # Draft blocks and decode steps: many tiny attention problems. Their cost is per-op overhead, which
        # worker threads only add to (waking them costs more than the work), so run them on this thread.
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(1)
        try:
            for kv, begin, end, start in small:
                out[0, begin:end] = small_attention(
                    query[0, :, begin:end], kv.buffer[layer, 0, :, : start + end - begin],
                    kv.buffer[layer, 1, :, : start + end - begin], start, scaling, window, softcap,
                ).transpose(0, 1)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)
    return out, None


def _first_key(start: int, window: int | None) -> int:
    """The first key position any query of a row starting at ``start`` can see (0 without a window)."""
    return 0 if window is None else max(0, start + 1 - window)


def _allowed(start: int, n: int, lo: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Bool [n, start + n - lo]: query i (position start + i) may see the key at position lo + j."""
    q = torch.arange(start, start + n, device=device).unsqueeze(1)
    k = torch.arange(lo, start + n, device=device).unsqueeze(0)
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def small_attention(
    q: torch.Tensor,  # [num_heads, n, head_dim]
    k: torch.Tensor,  # [num_kv_heads, start + n, head_dim]
    v: torch.Tensor,  # [num_kv_heads, start + n, head_dim]
    start: int,
    scaling: float | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_heads, n, head_dim]
    """Causal grouped-query attention of n new tokens (positions start..start+n-1) with two bmm calls.

    Query head h uses KV head h // (num_heads / num_kv_heads), as HF's ``repeat_kv`` does. ``sliding_window``
    and ``softcap`` as in :func:`ragged_attention` (only the window's keys are multiplied).
    """
    num_heads, n, head_dim = q.shape
    lo = _first_key(start, sliding_window)
    k, v = k[:, lo:], v[:, lo:]
    num_kv, total = k.shape[0], k.shape[1]
    group = num_heads // num_kv
    scale = scaling if scaling is not None else head_dim**-0.5
    scores = torch.bmm(q.reshape(num_kv, group * n, head_dim), k.transpose(1, 2)) * scale  # [kv, g*n, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if n > 1:  # one query sees every key from lo on: no mask
        hidden = ~_allowed(start, n, lo, sliding_window, q.device)  # [n, L]
        scores = scores.view(num_kv, group, n, total).masked_fill(hidden, float("-inf")).view(num_kv, group * n, total)
    return torch.bmm(torch.softmax(scores, dim=-1), v).view(num_heads, n, head_dim)


def register_attention() -> None:
    """Register :func:`ragged_attention` with transformers as ``ATTN_IMPLEMENTATION`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, ragged_attention)
