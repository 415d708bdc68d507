"""Attention of the target runner over the paged KV pool, registered with HF transformers' ``AttentionInterface``.

All rows of a batch (draft blocks of different sessions, prefill chunks) are flattened into one sequence of
T tokens by :class:`cloud_verifier.target.runner.TargetRunner`; projections and MLPs run over it as one matmul. Each
row's keys/values live in the pages of its session's page table in the :class:`~cloud_verifier.kv.pool.KVPool`.
:func:`ragged_attention`, registered under ``ATTN_IMPLEMENTATION`` so that any HF causal LM whose attention
layers use the interface (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, Granite, SmolLM, ...) runs it, sliding
windows and score soft-capping included, does per layer:

1. one ``index_copy_`` of the batch's new keys and values into the pool (a slot mapping [T], computed once
   per forward pass);
2. ONE attention call for the whole batch: rows are cut into pieces of at most ``piece`` queries (a prefill
   chunk becomes several pieces, a verify row is one), each piece's key pages are gathered from the pool with
   one ``index_select`` into a padded batch [pieces, num_kv_heads, keys, head_dim], and one
   ``scaled_dot_product_attention`` (or, with soft-capping, one batched matmul-softmax-matmul) runs over it
   with a boolean mask (causal, window, padding). The gather indices and masks are built once per forward
   pass (per window size) by :class:`PagedBatch` and shared by all layers.

Why this mechanism (measured, see docs/architecture.md "Paged KV cache"): it is plain torch on CPU and CUDA
(no torch.compile, no custom kernel); ``flex_attention`` without compile runs as an unfused reference that
materialises the scores, and nested-tensor SDPA has no mask for a query block ending at the end of its keys.
Grouped-query attention without copying keys: the query heads of one KV head are stacked as extra query rows.

:func:`reference_attention` is the per-row loop this replaced (two ``bmm`` calls, or one SDPA call for a long
prefill chunk, per row and layer): kept only as the reference the tests compare with
(:meth:`TargetRunner.reference_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec_runtime.cloud_verifier.kv.pool import KVPool

ATTN_IMPLEMENTATION = "specdec_ragged"
SMALL_ROW_TOKENS = 32  # reference loop: rows up to this many tokens take the single-threaded small path
PIECE_TOKENS = 16  # paged attention: queries per piece when rows of different lengths share a batch


class PagedBatch:
    """The rows of one forward pass, passed to every attention layer as the ``specdec_batch`` argument.

    Built by the target runner: :meth:`add_row` per row, then :meth:`finish` (the slot mapping). The gather
    plan of each window size (:meth:`plan`) is built by the first layer that needs it and reused by the others.
    """

    def __init__(self, pool: KVPool, reference: bool = False):
        self.pool = pool
        self.reference = reference
        self.rows: list[tuple[list[int], int, int, int]] = []  # (page table, first flat index, n, start position)
        self.slots: torch.Tensor | None = None  # [T] flat pool slot of each token
        self.plans: dict[tuple[int | None, int], tuple] = {}  # by (window, group): built on first use
        # hybrid targets: (session state, first flat index, n, start) per row (cloud_verifier.kv.recurrent_state)
        self.recurrent: list[tuple] = []

    def add_row(self, pages: list[int], begin: int, n: int, start: int) -> None:
        self.rows.append((pages, begin, n, start))

    def finish(self, device: torch.device) -> None:
        """Compute the slot mapping [T]: token at position p of a row goes to slot pages[p // bs] * bs + p % bs."""
        bs = self.pool.page_size
        slots = []
        for pages, _, n, start in self.rows:
            slots.extend(pages[p // bs] * bs + p % bs for p in range(start, start + n))
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)

    def plan(self, window: int | None, group: int, device: torch.device) -> tuple:
        """(query index [P * Q], key page index [P * NB], mask [P, 1, group * Q, NB * bs], output index [T],
        Q, NB) of the pieces for ``window`` (None = full attention), cached: P pieces of Q queries, NB key pages
        each; the mask is repeated for the ``group`` query heads stacked per KV head."""
        if (window, group) not in self.plans:
            self.plans[(window, group)] = self._build_plan(window, group, device)
        return self.plans[(window, group)]

    def _build_plan(self, window: int | None, group: int, device: torch.device) -> tuple:
        bs = self.pool.page_size
        longest = max(n for _, _, n, _ in self.rows)
        q = longest if len(self.rows) == 1 else min(longest, PIECE_TOKENS)
        pieces = []  # (page table, first flat index, piece length, first position, first key page)
        for pages, begin, n, start in self.rows:
            for off in range(0, n, q):
                m = min(q, n - off)
                pieces.append((pages, begin + off, m, start + off, _first_key(start + off, window) // bs))
        num_pages = max(-(-(pos + m) // bs) - lo for _, _, m, pos, lo in pieces)
        qidx, kidx, qpos, kfirst, oidx = [], [], [], [], []
        for i, (pages, first, m, pos, lo) in enumerate(pieces):
            # padded queries repeat the piece's last token (a real row of the mask: no all-masked softmax)
            qidx.extend(first + min(j, m - 1) for j in range(q))
            qpos.extend(pos + min(j, m - 1) for j in range(q))
            table = pages[lo : -(-(pos + m) // bs)]
            kidx.extend(table + [table[0]] * (num_pages - len(table)))  # padding pages: masked out
            kfirst.append(lo * bs)
            oidx.extend(i * q + j for j in range(m))
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        qp = as_long(qpos).view(len(pieces), 1, q, 1)
        kp = (as_long(kfirst).view(-1, 1) + torch.arange(num_pages * bs, device=device)).view(len(pieces), 1, 1, -1)
        mask = kp <= qp
        if window is not None:
            mask &= kp > qp - window
        return as_long(qidx), as_long(kidx), mask.repeat(1, 1, group, 1), as_long(oidx), q, num_pages


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
    specdec_batch: PagedBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, T, num_heads, head_dim], None)
    """Causal attention of every row of the batch over its own paged KV cache, one attention call per layer
    (writes the new keys/values into the pool first).

    ``sliding_window`` (Mistral, Qwen2, Phi-3, Gemma's local layers; None = full attention): a query at position
    i sees keys at positions i - sliding_window < j <= i, HF's convention. The whole cache is kept (rolling back
    stays free); only the window's key pages are read. ``softcap`` (Gemma 2): scores become
    softcap * tanh(s / softcap) before the softmax. HF's ``attention_mask`` is ignored: rows never see each
    other, and padding inside the call is masked out.

    Raises:
        RuntimeError: called without ``specdec_batch`` (the model was not run by the target runner).
    """
    if specdec_batch is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the specdec_batch argument")
    batch = specdec_batch
    layer = module.layer_idx
    keys, values = batch.pool.layer(layer, 0), batch.pool.layer(layer, 1)  # [slots, num_kv_heads, head_dim]
    keys.index_copy_(0, batch.slots, key[0].transpose(0, 1))
    values.index_copy_(0, batch.slots, value[0].transpose(0, 1))
    window = int(sliding_window) if sliding_window else None
    if batch.reference:
        return reference_attention(batch, layer, query, scaling, window, softcap), None
    pool = batch.pool.tensor
    num_heads, head_dim, num_kv = query.shape[1], query.shape[3], pool.shape[4]
    group = num_heads // num_kv
    qidx, kidx, mask, oidx, q, num_pages = batch.plan(window, group, query.device)
    pieces = mask.shape[0]
    # queries [pieces, num_kv, group * q, head_dim]: query head h uses KV head h // group, as HF's repeat_kv
    qs = query[0].transpose(0, 1).index_select(0, qidx).view(pieces, q, num_kv, group, head_dim)
    qs = qs.permute(0, 2, 3, 1, 4).reshape(pieces, num_kv, group * q, head_dim)
    ks = pool[layer, 0].index_select(0, kidx).view(pieces, num_pages * batch.pool.page_size, num_kv, head_dim)
    vs = pool[layer, 1].index_select(0, kidx).view(pieces, num_pages * batch.pool.page_size, num_kv, head_dim)
    o = attend(qs, ks.transpose(1, 2), vs.transpose(1, 2), mask, scaling, softcap)
    o = o.view(pieces, num_kv, group, q, head_dim).permute(0, 3, 1, 2, 4).reshape(pieces * q, num_heads, head_dim)
    return o.index_select(0, oidx).unsqueeze(0), None


def attend(
    q: torch.Tensor,  # [B, num_kv_heads, Q, head_dim]
    k: torch.Tensor,  # [B, num_kv_heads, L, head_dim]
    v: torch.Tensor,  # [B, num_kv_heads, L, head_dim]
    mask: torch.Tensor,  # bool [B, 1, Q, L]: True = may attend
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:  # [B, num_kv_heads, Q, head_dim]
    """The one attention call of a layer: SDPA, or with ``softcap`` (no SDPA support) matmul, tanh cap,
    masked softmax, matmul. Every row of ``mask`` must allow at least one key."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * (scale / softcap)) * softcap
    return torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v)


def reference_attention(
    batch: PagedBatch, layer: int, query: torch.Tensor, scaling: float | None, window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [1, T, num_heads, head_dim]
    """The per-row reference loop (the attention before the paged pool): per row, its keys/values gathered from
    its page table, then one SDPA call (a prefill chunk of more than ``SMALL_ROW_TOKENS`` tokens) or
    :func:`small_attention` (two ``bmm`` calls). Kept only for the tests that compare the paged path with it.
    The new keys must already be in the pool."""
    bs = batch.pool.page_size
    keys, values = batch.pool.layer(layer, 0), batch.pool.layer(layer, 1)
    num_tokens = query.shape[2]
    out = query.new_empty(1, num_tokens, query.shape[1], query.shape[3])
    for pages, begin, n, start in batch.rows:
        end = begin + n
        slots = torch.tensor([pages[p // bs] * bs + p % bs for p in range(start + n)], device=query.device)
        k = keys.index_select(0, slots).transpose(0, 1)  # [num_kv_heads, start + n, head_dim]
        v = values.index_select(0, slots).transpose(0, 1)
        if n > SMALL_ROW_TOKENS and softcap is None:
            q = query[0, :, begin:end]  # [num_heads, n, head_dim]
            lo = _first_key(start, window)
            mask = None if start == 0 and window is None else _allowed(start, n, lo, window, q.device)
            o = F.scaled_dot_product_attention(
                q, k[:, lo:], v[:, lo:], attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True,
            )  # [num_heads, n, head_dim]
        else:
            o = small_attention(query[0, :, begin:end], k, v, start, scaling, window, softcap)
        out[0, begin:end] = o.transpose(0, 1)
    return out


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
