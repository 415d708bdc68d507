"""The target model runner: ragged batched forward passes over many sessions with a KV cache per session.

All rows of a batch (draft blocks of different sessions, prefill chunks) are flattened into one sequence of
T tokens, so the projections and MLPs of every row run as one matmul with no padding (the "ragged" or
"packed" batching of vLLM / ORCA). Attention runs per row against that row's own KV cache, through a custom
attention function registered with HF transformers' ``AttentionInterface`` (:mod:`cloud_verifier.attention`):
the model is any HF causal LM whose attention layers use that interface and whose layers all hold a KV cache
(:mod:`cloud_verifier.architectures`: checked at load time; Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, Granite,
SmolLM, ... are tested).

KV cache: each session owns a preallocated buffer ``[num_layers, 2, num_kv_heads, capacity, head_dim]``
reserved at open time from a token budget (admission control: a session that does not fit is refused rather
than slowing the others down). Rolling back after a rejection is free: positions past the committed length are
simply overwritten by the next forward pass.

Device and dtype: :func:`resolve_device` / :func:`resolve_dtype` turn the settings' names (``auto`` included)
into torch objects; asking for CUDA where there is none is an error, not a silent fallback.

Reference: :meth:`TargetRunner.reference_logits` runs the unmodified HF model (SDPA attention, DynamicCache)
and backs the fast path in tests.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cloud_verifier.architectures import apply_logits_transforms, check_target_architecture, self_check
from cloud_verifier.attention import ATTN_IMPLEMENTATION, RaggedBatch, register_attention
from common.errors import CapacityError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device for a setting: ``auto`` (CUDA when ``torch.cuda.is_available()``, else CPU), ``cpu``,
    ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: an unknown name, or CUDA asked for where torch has none (or no GPU number N); one line.
    """
    name = str(device).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(name)
    except RuntimeError:
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available here (use auto or cpu)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The torch dtype of weights and KV cache for a setting: ``auto`` (bfloat16 on CUDA, float32 on CPU),
    ``float32``, ``bfloat16``, ``float16``, or a torch dtype (returned as is).

    Raises:
        ValueError: an unknown name (one line).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).strip().lower()
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _mapped_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in its own private anonymous memory mapping.

    A KV cache (megabytes to tens of megabytes) allocated through malloc lands in the heap once glibc's dynamic
    mmap threshold has risen past its size (it rises to the size of every mapped block freed, up to 32 MiB),
    and heap memory freed between live blocks is not given back: a verifier's RSS stayed ~170 MB above idle
    after 16 concurrent sessions closed (``bench --replay``). A mapping of its own is unmapped when the tensor
    is freed, so RSS returns to idle; its pages, like torch.empty's, take memory only once written.
    """
    import math
    import mmap

    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    nbytes = count * (torch.finfo(dtype).bits // 8)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype, count=count).view(shape)


def _malloc_trim() -> bool:
    """glibc's malloc_trim(0): free heap pages (in every arena) go back to the OS; False where there is none."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # not glibc
        return False


class SessionKV:
    """KV cache of one session: ``buffer`` [num_layers, 2, num_kv_heads, capacity, head_dim]."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    @property
    def capacity(self) -> int:
        """Tokens the buffer can hold."""
        return self.buffer.shape[3]



@contextlib.contextmanager
def _quiet_weight_loading():
    """transformers' "Loading weights" bar off while the target loads: the CLI and ``serve`` report that step
    themselves, and a bar on a non-terminal stderr (logs, pipes) is a run of carriage returns."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


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


class TargetRunner:
    """Runs the target model (PyTorch, HF transformers) for ragged batches of rows.

    Args:
        model_dir: local HF causal-LM directory (safetensors + config + tokenizer).
        kv_cache_budget_tokens: total KV capacity, tokens, over all sessions (admission budget).
        device: "auto", "cpu", "cuda" or "cuda:N" (:func:`resolve_device`; "auto" = CUDA when available).
        dtype: weights and KV cache: a torch dtype or "auto" / "float32" / "bfloat16" / "float16"
            (:func:`resolve_dtype`; "auto" = bfloat16 on CUDA, float32 on CPU). float32 by default: exactness
            tests compare fp32.
        num_threads: torch intra-op threads (None = torch's default).
        check_architecture: after loading, compare a 12-token ragged forward with the HF reference
            (:func:`cloud_verifier.architectures.self_check`, a few ms for a small model).

    Raises:
        common.paths.ModelNotFoundError: model_dir is not a causal-LM directory.
        cloud_verifier.architectures.UnsupportedArchitectureError (a ValueError): an architecture the ragged
            forward cannot run (one line naming what is missing).
        ValueError: unknown device or dtype, or CUDA asked for where there is none.
    """

    def __init__(
        self,
        model_dir: str | Path,
        kv_cache_budget_tokens: int = 65536,
        device: str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        num_threads: int | None = None,
        check_architecture: bool = True,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from common.paths import resolve_target_dir

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        model_dir = resolve_target_dir(model_dir)
        if num_threads:
            torch.set_num_threads(num_threads)
        register_attention()
        self.model_dir = Path(model_dir)
        self.config = AutoConfig.from_pretrained(model_dir)
        check_target_architecture(self.config)
        with _quiet_weight_loading():
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=self.dtype, attn_implementation=ATTN_IMPLEMENTATION
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
        self._forwards_since_trim = 0  # forward passes since release_idle_memory last trimmed the heap
        self._decoder = self.model.get_decoder()
        self._lm_head = self.model.get_output_embeddings()
        if check_architecture:
            self_check(self)

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
        shape = (self.num_layers, 2, self.num_kv_heads, capacity_tokens, self.head_dim)
        if self.device.type == "cpu":
            buffer = _mapped_empty(shape, self.dtype)
        else:  # pages are only touched (and count as resident memory) once written
            buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        return SessionKV(buffer)

    def free(self, kv: SessionKV) -> None:
        """Return a session's KV cache to the budget (idempotent)."""
        with self._forward_lock:  # waits for a forward pass that may be using it
            if kv.buffer.numel() == 0:
                return
            with self._lock:
                self._reserved_tokens -= kv.capacity
            kv.buffer = kv.buffer.new_empty((self.num_layers, 2, self.num_kv_heads, 0, self.head_dim))

    def release_idle_memory(self) -> bool:
        """Give the heap's free pages back to the OS (glibc ``malloc_trim``) if a forward pass ran since the last
        call: the activations of large batches leave freed but resident heap pages behind. Meant for idle times
        (the reaper calls it when no session is held); holds off forward passes while it runs (~20-40 ms after a
        busy period). Returns True when memory was trimmed."""
        if not self._forwards_since_trim or self.device.type != "cpu":
            return False
        with self._forward_lock:
            self._forwards_since_trim = 0
            return _malloc_trim()

    # ---------------------------------------------------------------- forward
    def forward(self, rows: list[ForwardRow]) -> list[np.ndarray | None]:
        """One target forward pass over a ragged batch.

        Returns per row: logits float32 [len(token_ids), vocab_size] ("all"), [1, vocab_size] ("last"), or None.

        Raises:
            ValueError: a row writes past its KV capacity (or its KV cache was freed) or is empty.
        """
        with self._forward_lock, torch.inference_mode():
            self._forwards_since_trim += 1
            return self._forward(rows)

    def _forward(self, rows: list[ForwardRow]) -> list[np.ndarray | None]:
        batch = RaggedBatch()
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
        logits = apply_logits_transforms(self.config, self._lm_head(hidden[0].index_select(0, index)))
        logits = logits.float().cpu().numpy()  # [num_wanted, vocab_size]
        return [None if span is None else logits[span[0] : span[1]] for span in spans]

    @torch.inference_mode()
    def reference_logits(self, token_ids: list[int]) -> np.ndarray:  # [len, vocab_size] float32
        """Logits of the unmodified HF model (SDPA attention, or eager where the model has no SDPA path, e.g.
        Gemma 2's soft-capping; no cache) for a whole sequence: the reference."""
        self.model.set_attn_implementation("sdpa" if self.model._supports_sdpa else "eager")
        try:
            ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
            return self.model(input_ids=ids).logits[0].float().cpu().numpy()
        finally:
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
