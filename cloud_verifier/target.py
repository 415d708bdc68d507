"""The target model runner: ragged batched forward passes over many sessions with a KV cache per session.

All rows of a batch (draft blocks of different sessions, prefill chunks) are flattened into one sequence of
T tokens, so the projections and MLPs of every row run as one matmul with no padding (the "ragged" or
"packed" batching of vLLM / ORCA). Attention runs per row against that row's own KV cache, through a custom
attention function registered with HF transformers' ``AttentionInterface``: the model is any HF causal LM
whose attention layers use that interface (Llama, Mistral, Qwen2, SmolLM, ...). Padding never exists, so it
cannot leak into a row's result.

KV cache: each session owns a preallocated buffer ``[num_layers, 2, num_kv_heads, capacity, head_dim]``
reserved at open time from a token budget (admission control: a session that does not fit is refused rather
than slowing the others down). Rolling back after a rejection is free: positions past the committed length are
simply overwritten by the next forward pass.

Reference: :meth:`TargetRunner.reference_logits` runs the unmodified HF model (SDPA attention, DynamicCache)
and backs the fast path in tests.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common.errors import CapacityError

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "specdec_ragged"


class SessionKV:
    """KV cache of one session: ``buffer`` [num_layers, 2, num_kv_heads, capacity, head_dim]."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    @property
    def capacity(self) -> int:
        """Tokens the buffer can hold."""
        return self.buffer.shape[3]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


@dataclass
class ForwardRow:
    """One row of a ragged batch.

    token_ids: tokens fed at positions start_position .. start_position + len - 1; their keys/values are written
        into ``kv`` at those positions, and they attend to kv[:start_position] plus each other (causally).
    logits: which of the row's positions need logits: "all", "last" or "none" (prefill).
    """

    kv: SessionKV
    token_ids: list[int]
    start_position: int
    logits: str = "all"


@dataclass
class _RaggedBatch:
    # (kv, first token index in the flat batch, end index, start position) per row
    rows: list[tuple[SessionKV, int, int, int]] = field(default_factory=list)


def _ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_heads, T, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, T, head_dim] (RoPE applied)
    value: torch.Tensor,  # [1, num_kv_heads, T, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    specdec_batch: _RaggedBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, T, num_heads, head_dim], None)
    """Per-row causal attention over each row's own KV cache (writes the new keys/values into it)."""
    if specdec_batch is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the specdec_batch argument")
    layer = module.layer_idx
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
        if n > SMALL_ROW_TOKENS:  # prefill chunk: one multi-threaded SDPA call pays off
            q = query[0, :, begin:end]  # [num_heads, n, head_dim]
            if start == 0:
                mask, causal = None, True
            else:  # query i (absolute position start+i) sees keys 0 .. start+i
                mask, causal = torch.arange(start + n).unsqueeze(0) <= torch.arange(start, start + n).unsqueeze(1), False
            o = F.scaled_dot_product_attention(
                q, keys[:, : start + n], values[:, : start + n], attn_mask=mask, is_causal=causal, scale=scaling,
                enable_gqa=True,
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
                out[0, begin:end] = _small_attention(
                    query[0, :, begin:end], kv.buffer[layer, 0, :, : start + end - begin],
                    kv.buffer[layer, 1, :, : start + end - begin], start, scaling,
                ).transpose(0, 1)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)
    return out, None


SMALL_ROW_TOKENS = 32  # rows up to this many tokens take the single-threaded small-attention path


def _small_attention(
    q: torch.Tensor,  # [num_heads, n, head_dim]
    k: torch.Tensor,  # [num_kv_heads, start + n, head_dim]
    v: torch.Tensor,  # [num_kv_heads, start + n, head_dim]
    start: int,
    scaling: float | None,
) -> torch.Tensor:  # [num_heads, n, head_dim]
    """Causal grouped-query attention of n new tokens (positions start..start+n-1) with two bmm calls.

    Query head h uses KV head h // (num_heads / num_kv_heads), as HF's ``repeat_kv`` does.
    """
    num_heads, n, head_dim = q.shape
    num_kv = k.shape[0]
    group = num_heads // num_kv
    scale = scaling if scaling is not None else head_dim**-0.5
    scores = torch.bmm(q.reshape(num_kv, group * n, head_dim), k.transpose(1, 2)) * scale  # [kv, g*n, L]
    if n > 1:
        total = start + n
        future = torch.arange(total).unsqueeze(0) > torch.arange(start, total).unsqueeze(1)  # [n, L]
        scores = scores.view(num_kv, group, n, total).masked_fill(future, float("-inf")).view(num_kv, group * n, total)
    return torch.bmm(torch.softmax(scores, dim=-1), v).view(num_heads, n, head_dim)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _ragged_attention)


class TargetRunner:
    """Runs the target model (PyTorch, HF transformers) for ragged batches of rows.

    Args:
        model_dir: local HF causal-LM directory (safetensors + config + tokenizer).
        kv_cache_budget_tokens: total KV capacity, tokens, over all sessions (admission budget).
        device: "cpu" or "cuda" ("cuda" falls back to CPU when torch has no CUDA).
        dtype: torch dtype of weights and KV cache (float32 by default: exactness tests compare fp32).
        num_threads: torch intra-op threads (None = torch's default).

    Raises:
        common.paths.ModelNotFoundError: model_dir is not a causal-LM directory.
    """

    def __init__(
        self,
        model_dir: str | Path,
        kv_cache_budget_tokens: int = 65536,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_threads: int | None = None,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from common.paths import resolve_target_dir

        model_dir = resolve_target_dir(model_dir)
        if device.startswith("cuda") and not torch.cuda.is_available():
            log.warning("CUDA requested but not available; the target runs on the CPU")
            device = "cpu"
        if num_threads:
            torch.set_num_threads(num_threads)
        _register_attention()
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.config = AutoConfig.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        ).to(self.device)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        cfg = self.config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]  # logits width
        self.max_context_tokens = int(getattr(cfg, "max_position_embeddings", 2048))
        self.kv_cache_budget_tokens = int(kv_cache_budget_tokens)
        self._reserved_tokens = 0
        self._lock = threading.Lock()  # budget accounting
        self._forward_lock = threading.Lock()  # a KV cache is never freed under a running forward pass
        self._decoder = self.model.get_decoder()
        self._lm_head = self.model.get_output_embeddings()

    # ---------------------------------------------------------------- KV cache budget
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes (all layers, keys and values)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def kv_reserved_tokens(self) -> int:
        return self._reserved_tokens

    @property
    def kv_reserved_bytes(self) -> int:
        return self._reserved_tokens * self.kv_bytes_per_token

    def allocate(self, capacity_tokens: int) -> SessionKV:
        """Reserve a KV cache for ``capacity_tokens`` tokens.

        Raises:
            CapacityError: the budget (kv_cache_budget_tokens) has no room for it.
        """
        capacity_tokens = int(capacity_tokens)
        with self._lock:
            if self._reserved_tokens + capacity_tokens > self.kv_cache_budget_tokens:
                raise CapacityError(
                    f"KV cache full: {capacity_tokens} tokens requested, "
                    f"{self.kv_cache_budget_tokens - self._reserved_tokens} of {self.kv_cache_budget_tokens} free"
                )
            self._reserved_tokens += capacity_tokens
        # torch.empty: pages are only touched (and count as resident memory) once written
        buffer = torch.empty(
            (self.num_layers, 2, self.num_kv_heads, capacity_tokens, self.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        return SessionKV(buffer)

    def free(self, kv: SessionKV) -> None:
        """Return a session's KV cache to the budget (idempotent)."""
        with self._forward_lock:  # waits for a forward pass that may be using it
            if kv.buffer.numel() == 0:
                return
            with self._lock:
                self._reserved_tokens -= kv.capacity
            kv.buffer = kv.buffer.new_empty((self.num_layers, 2, self.num_kv_heads, 0, self.head_dim))

    # ---------------------------------------------------------------- forward
    def forward(self, rows: list[ForwardRow]) -> list[np.ndarray | None]:
        """One target forward pass over a ragged batch.

        Returns per row: logits float32 [len(token_ids), vocab_size] ("all"), [1, vocab_size] ("last"), or None.

        Raises:
            ValueError: a row writes past its KV capacity (or its KV cache was freed) or is empty.
        """
        with self._forward_lock, torch.inference_mode():
            return self._forward(rows)

    def _forward(self, rows: list[ForwardRow]) -> list[np.ndarray | None]:
        batch = _RaggedBatch()
        flat_ids: list[int] = []
        positions: list[int] = []
        want: list[int] = []
        spans: list[tuple[int, int] | None] = []
        for row in rows:
            n = len(row.token_ids)
            if n == 0:
                raise ValueError("empty forward row")
            if row.start_position + n > row.kv.capacity:
                raise ValueError(
                    f"row writes positions up to {row.start_position + n} past its KV capacity {row.kv.capacity}"
                )
            begin = len(flat_ids)
            batch.rows.append((row.kv, begin, begin + n, row.start_position))
            flat_ids.extend(row.token_ids)
            positions.extend(range(row.start_position, row.start_position + n))
            if row.logits == "all":
                spans.append((len(want), len(want) + n))
                want.extend(range(begin, begin + n))
            elif row.logits == "last":
                spans.append((len(want), len(want) + 1))
                want.append(begin + n - 1)
            else:
                spans.append(None)
        input_ids = torch.tensor([flat_ids], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        hidden = self._decoder(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, specdec_batch=batch
        ).last_hidden_state  # [1, T, hidden_size]
        if not want:
            return [None] * len(rows)
        index = torch.tensor(want, dtype=torch.long, device=self.device)
        logits = self._lm_head(hidden[0].index_select(0, index)).float().cpu().numpy()  # [num_wanted, vocab_size]
        return [None if span is None else logits[span[0] : span[1]] for span in spans]

    @torch.inference_mode()
    def reference_logits(self, token_ids: list[int]) -> np.ndarray:  # [len, vocab_size] float32
        """Logits of the unmodified HF model (SDPA attention, no cache) for a whole sequence: the reference."""
        self.model.set_attn_implementation("sdpa")
        try:
            ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
            return self.model(input_ids=ids).logits[0].float().cpu().numpy()
        finally:
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)


def time_forward(runner: TargetRunner, num_tokens: int, past_tokens: int = 100, repeats: int = 5) -> float:
    """Median wall time of a single-row forward of ``num_tokens`` tokens after ``past_tokens``, ms (benchmarks)."""
    kv = runner.allocate(past_tokens + num_tokens)
    try:
        ids = [1] * (past_tokens + num_tokens)
        runner.forward([ForwardRow(kv, ids[:past_tokens], 0, "none")]) if past_tokens else None
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            runner.forward([ForwardRow(kv, ids[past_tokens:], past_tokens, "all")])
            times.append((time.perf_counter() - t) * 1000)
        return float(np.median(times))
    finally:
        runner.free(kv)
