"""The target model runner: ragged batched forward passes over many sessions with a paged KV cache.

All rows of a batch (draft blocks of different sessions, prefill chunks) are flattened into one sequence of
T tokens, so the projections and MLPs of every row run as one matmul with no padding (the "ragged" or
"packed" batching of vLLM / ORCA). Attention runs as ONE call per layer for the whole batch over the paged KV
pool, through a custom attention function registered with HF transformers' ``AttentionInterface``
(:mod:`cloud_verifier.target.attention`): the model is any HF causal LM whose attention layers use that interface and
whose layers all hold a KV cache (:mod:`cloud_verifier.target.architectures`: checked at load time; Llama, Mistral,
Qwen2/3, Phi-3, Gemma 2/3, Granite, SmolLM, ... are tested), or a hybrid whose conv / SSM / linear-attention
layers run row by row on each session's recurrent state (:mod:`cloud_verifier.kv.recurrent_state`, ``kv.recurrent``;
LFM2, Qwen3-Next, Qwen3.5, Bamba, Granite 4 hybrid, Nemotron-H, Falcon-H1; eager only, no prefix sharing).

KV cache: one pool of fixed-size pages for all sessions (:class:`cloud_verifier.kv.pool.KVPool`, allocated
once from the token budget), a page table per session (:class:`SessionKV`). A session holds pages only for
the tokens it holds: growing (more positions, ExtendSession) appends pages without copying, rolling back a
rejected tail drops whole pages past the committed length (:meth:`TargetRunner.truncate`), freeing drops all
(admission control: a session or a block that finds no free page is refused rather than slowing the others
down).

Device and dtype: :func:`resolve_device` / :func:`resolve_dtype` turn the settings' names (``auto`` included)
into torch objects; asking for CUDA where there is none is an error, not a silent fallback.

Reference: :meth:`TargetRunner.reference_logits` runs the unmodified HF model (SDPA attention, DynamicCache)
and backs the fast path in tests.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import numpy as np
import torch

from specdec_runtime.cloud_verifier.target.architectures import apply_logits_transforms, check_target_architecture, self_check
from specdec_runtime.cloud_verifier.target.features import capture_layer_inputs, row_features
from specdec_runtime.cloud_verifier.target.attention import ATTN_IMPLEMENTATION, PagedBatch, register_attention
from specdec_runtime.cloud_verifier.target.compiled_forward import CompiledForward
from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow
from specdec_runtime.cloud_verifier.kv.pool import KVPool, SessionKV
from specdec_runtime.cloud_verifier.kv.recurrent_state import RecurrentStateError, SessionState, install_row_mixers
from specdec_runtime.common.errors import CapacityError

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


def _malloc_trim() -> bool:
    """glibc's malloc_trim(0): free heap pages (in every arena) go back to the OS; False where there is none."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # not glibc
        return False


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


class TargetRunner:
    """Runs the target model (PyTorch, HF transformers) for ragged batches of rows.

    Args:
        model_dir: local HF causal-LM directory (safetensors + config + tokenizer).
        kv_cache_budget_tokens: total KV capacity, tokens, over all sessions (admission budget): the pool holds
            ceil(budget / kv_page_size) pages.
        device: "auto", "cpu", "cuda" or "cuda:N" (:func:`resolve_device`; "auto" = CUDA when available).
        dtype: weights and KV cache: a torch dtype or "auto" / "float32" / "bfloat16" / "float16"
            (:func:`resolve_dtype`; "auto" = bfloat16 on CUDA, float32 on CPU). float32 by default: exactness
            tests compare fp32.
        num_threads: torch intra-op threads (None = torch's default).
        check_architecture: after loading, compare a 12-token ragged forward with the HF reference
            (:func:`cloud_verifier.target.architectures.self_check`, a few ms for a small model).
        kv_page_size: tokens per KV page of the paged pool (:mod:`cloud_verifier.kv.pool`).
        compile_mode: "off", "torch_compile" or "cuda_graphs" (:mod:`cloud_verifier.target.compiled_forward`;
            cuda_graphs off the GPU logs one line and runs eagerly). Hybrid targets always run "off".

    Raises:
        common.paths.ModelNotFoundError: model_dir is not a causal-LM directory.
        cloud_verifier.target.architectures.UnsupportedArchitectureError (a ValueError): an architecture the ragged
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
        kv_page_size: int = 16,
        compile_mode: str = "off",
    ):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from specdec_runtime.common.paths import resolve_target_dir

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
        # hybrid targets: conv / SSM / linear-attention layers run row by row on per-session states
        self.recurrent_layers = install_row_mixers(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        cfg = self.config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]  # logits width
        self.max_context_tokens = int(getattr(cfg, "max_position_embeddings", 2048))
        self.kv_cache_budget_tokens = int(kv_cache_budget_tokens)
        # one pool for all sessions, allocated once (its CPU memory pages take memory only once written)
        self.kv_pool = KVPool(self.num_layers, -(-self.kv_cache_budget_tokens // int(kv_page_size)),
                              int(kv_page_size), self.num_kv_heads, self.head_dim, self.dtype, self.device)
        self._attention_mode = "paged"  # or "reference" (the per-row loop, for tests)
        self.prefix_cache = None  # set by prefix_cache.attach_prefix_cache: allocations evict through it
        self._forward_lock = threading.Lock()  # a KV cache is never freed under a running forward pass
        self._forwards_since_trim = 0  # forward passes since release_idle_memory last trimmed the heap
        # the decoder and LM head the compiled forward (compiled_forward.py) runs too
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        # the per-row loop of recurrent layers is plain Python: hybrids run eagerly
        self._compiled = CompiledForward(self, "off" if self.recurrent_layers else compile_mode)
        if check_architecture:
            self_check(self)

    @property
    def forward_lock(self) -> threading.Lock:
        """Held for each forward pass (tensor parallel: whoever broadcasts to the ranks outside a pass holds it)."""
        return self._forward_lock

    # ---------------------------------------------------------------- paged KV cache
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes (all layers, keys and values)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def kv_page_size(self) -> int:
        """Tokens per KV page."""
        return self.kv_pool.page_size

    @property
    def kv_reserved_tokens(self) -> int:
        """KV cache in use, tokens: pages held by sessions × page size (pages are used whole)."""
        return self.kv_pool.pages.num_used * self.kv_pool.page_size

    @property
    def kv_reserved_bytes(self) -> int:
        return self.kv_reserved_tokens * self.kv_bytes_per_token

    def allocate(self, capacity_tokens: int, reserve_tokens: int | None = None) -> SessionKV:
        """A session's KV cache that may grow to ``capacity_tokens`` tokens, with pages for its first
        ``reserve_tokens`` positions now (None = all ``capacity_tokens``; the rest is added as it is written).

        Raises:
            CapacityError: the pool has too few free pages, or fewer pages in all than ``capacity_tokens``
                needs (a session that could never finish; nothing is allocated).
        """
        kv = SessionKV(capacity_tokens)
        self.ensure(kv, capacity_tokens if reserve_tokens is None else min(reserve_tokens, capacity_tokens))
        return kv

    def ensure(self, kv: SessionKV, tokens: int) -> None:
        """Grow the page table to hold positions 0..tokens-1 (no copy: more pages).

        Raises:
            CapacityError: too few free pages, or the session's limit (``kv.capacity``) exceeds the whole pool:
                a session that could never finish (the table stays as it was).
            ValueError: the cache was freed.
        """
        if kv.freed:
            raise ValueError("KV cache used after it was freed")
        self.check_fits(kv.capacity)
        missing = -(-int(tokens) // self.kv_pool.page_size) - len(kv.pages)
        if missing > 0:  # with a prefix cache, evictable cached pages are evicted when the free list is short
            allocate = self.kv_pool.pages.allocate if self.prefix_cache is None else self.prefix_cache.allocate
            kv.pages.extend(allocate(missing))

    def check_fits(self, capacity_tokens: int) -> None:
        """Raises CapacityError when a session of up to ``capacity_tokens`` tokens could not fit in the whole
        pool even alone (it could never finish: refused at open, never preempted for)."""
        pool_tokens = self.kv_pool.num_pages * self.kv_pool.page_size
        if capacity_tokens > pool_tokens:
            raise CapacityError(f"KV cache full: a session of up to {capacity_tokens} tokens cannot fit in the "
                                f"{pool_tokens} tokens of the whole cache")

    def try_ensure(self, kv: SessionKV, tokens: int) -> bool:
        """:meth:`ensure`, False instead of CapacityError when the pool is short right now (the batcher then
        gets the pages before the forward pass, preempting if it must). A preempted table is left alone.

        Raises:
            CapacityError: the session could not fit in the whole pool. ValueError: the cache was freed.
        """
        if kv.rebuild_from is not None:
            return False
        self.check_fits(kv.capacity)
        try:
            self.ensure(kv, tokens)
        except CapacityError:
            return False
        return True

    def preempt(self, kv: SessionKV) -> int:
        """Drop every page of a session's table (recompute preemption): pages no one else holds go back to the
        pool, cached full pages stay in the prefix cache as evictable; ``kv.rebuild_from`` = 0. Returns pages
        dropped. The caller (the target thread, between forward passes, under the session table's lock) makes
        sure no forward pass uses the table."""
        pages, kv.pages = kv.pages, []
        kv.rebuild_from, kv.recurrent = 0, None
        self.kv_pool.pages.decref(pages)
        return len(pages)

    def truncate(self, kv: SessionKV, tokens: int) -> None:
        """Roll the page table back to positions 0..tokens-1: whole pages past them go back to the pool (the
        partly used last page stays; its positions past ``tokens`` are overwritten by the next forward)."""
        keep = max(0, -(-int(tokens) // self.kv_pool.page_size))
        if len(kv.pages) > keep:
            dropped = kv.pages[keep:]
            del kv.pages[keep:]
            self.kv_pool.pages.decref(dropped)

    def free(self, kv: SessionKV) -> None:
        """Return a session's pages to the pool, and their memory to the OS (idempotent; waits for a forward
        pass that may use them)."""
        with self._forward_lock:
            if kv.freed:
                return
            pages, kv.pages = kv.pages, []
            kv.freed, kv.capacity, kv.recurrent = True, 0, None
            self.kv_pool.pages.decref(pages)
            self.kv_pool.release_free(pages)  # resident memory back to idle (a page kept cached stays)

    def release_idle_memory(self) -> bool:
        """Give memory back to the OS at idle times (the reaper calls it when no session is held): the memory
        of free KV pages (:meth:`KVPool.release_free`) and, if a forward pass ran since the last call, the
        heap's free pages (glibc ``malloc_trim``: the activations of large batches leave freed but resident
        heap pages behind). Holds off forward passes while it runs. Returns True when memory was released."""
        if self.device.type != "cpu":
            return False
        with self._forward_lock:
            released = self.kv_pool.release_free() > 0
            if not self._forwards_since_trim:
                return released
            self._forwards_since_trim = 0
            return _malloc_trim() or released

    @contextlib.contextmanager
    def reference_attention(self):
        """Run forward passes with the per-row reference loop (:func:`cloud_verifier.target.attention.reference_attention`)
        instead of the one-call-per-layer paged attention, for the tests that compare them."""
        self._attention_mode = "reference"
        try:
            yield
        finally:
            self._attention_mode = "paged"

    # ---------------------------------------------------------------- forward
    def forward(self, rows: list[ForwardRow], as_tensors: bool = False) -> list:
        """One target forward pass over a ragged batch.

        Returns per row: logits float32 [len(token_ids), vocab_size] ("all"), [1, vocab_size] ("last"), or None;
        numpy arrays, or with ``as_tensors`` torch tensors on the model's device (views of one tensor, no host
        copy).

        Raises:
            ValueError: a row writes past its KV capacity (or its KV cache was freed) or is empty.
            CapacityError: the pool has no free page for a row's new positions (nothing runs).
        """
        with self._forward_lock, torch.inference_mode():
            self._forwards_since_trim += 1
            return self._forward(rows, as_tensors)

    def _forward(self, rows: list[ForwardRow], as_tensors: bool) -> list:
        batch = PagedBatch(self.kv_pool, reference=self._attention_mode == "reference")
        flat_ids: list[int] = []
        positions: list[int] = []
        want: list[int] = []
        spans: list[tuple[int, int] | None] = []
        for row in rows:
            n = len(row.token_ids)
            if n == 0:
                raise ValueError("empty forward row")
            if row.kv.freed or row.start_position + n > row.kv.capacity:
                raise ValueError(
                    f"row writes positions up to {row.start_position + n} past its KV capacity {row.kv.capacity}"
                )
            self.ensure(row.kv, row.start_position + n)  # normally done before: no-op
            begin = len(flat_ids)
            batch.add_row(row.kv.pages, begin, n, row.start_position)
            flat_ids.extend(row.token_ids)
            positions.extend(range(row.start_position, row.start_position + n))
            k = {"all": n, "last": 1}.get(row.logits, row.logits)  # logits of the row's last k positions
            if isinstance(k, int) and 0 < k <= n:
                spans.append((len(want), len(want) + k))
                want.extend(range(begin + n - k, begin + n))
            else:  # "none" (prefill)
                spans.append(None)
        batch.finish(self.device)
        if self.recurrent_layers:
            batch.recurrent = self._session_states(rows)
        input_ids = torch.tensor([flat_ids], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        index = torch.tensor(want, dtype=torch.long, device=self.device)
        layers = {i for row in rows for i in (row.feature_layers or ())}
        # features come from the eager pass's hooks: a pass that keeps them skips the compiled forward
        logits = self._compiled.run(batch, input_ids, position_ids, index, rows) if want and not layers else None
        if logits is None:  # eager (compile off, a first pass, a prefill, a shape without a CUDA graph)
            try:
                with capture_layer_inputs(self.decoder, layers) as captured:
                    hidden = self.decoder(
                        input_ids=input_ids, position_ids=position_ids, use_cache=False, specdec_batch=batch
                    ).last_hidden_state  # [1, T, hidden_size]
                if layers:
                    self._keep_features(rows, captured, hidden)
            except BaseException:
                for row in rows:  # some layers may have moved on: the next row rebuilds from position 0
                    row.kv.recurrent = None
                raise
            for state, _, n, start in batch.recurrent:
                state.finish(start, n)
            self._compiled.record(batch)
            if not want:
                return [None] * len(rows)
            logits = apply_logits_transforms(self.config, self.lm_head(hidden[0].index_select(0, index))).float()
        if not as_tensors:  # [num_wanted, vocab_size]
            logits = logits.cpu().numpy()
        return [None if span is None else logits[span[0] : span[1]] for span in spans]

    def _keep_features(self, rows: list[ForwardRow], captured: dict, hidden) -> None:
        """Set ``row.hidden`` of every row that asked for features (:mod:`cloud_verifier.target.features`)."""
        begin = 0
        for row in rows:
            n = len(row.token_ids)
            if row.feature_layers:
                row.hidden = row_features(captured, hidden, self.num_layers, row.feature_layers, begin, n)
            begin += n

    def _session_states(self, rows: list[ForwardRow]) -> list[tuple[SessionState, int, int, int]]:
        """(state, first flat index, n, start) of every row, for the recurrent layers; a session without a state
        gets a fresh one.

        Raises:
            RecurrentStateError (a ValueError): a row starts where its session's state does not reach
                (:meth:`SessionState.reaches`), or one session has two rows in the batch.
        """
        out, begin, seen = [], 0, set()
        for row in rows:
            if row.kv.recurrent is None:
                row.kv.recurrent = SessionState()
            state, n = row.kv.recurrent, len(row.token_ids)
            if id(state) in seen or not state.reaches(row.start_position):
                raise RecurrentStateError(
                    f"a row at position {row.start_position} of a hybrid target's session "
                    + ("repeats its session in one batch" if id(state) in seen else
                       f"is past its recurrent state (positions {state.position}..{state.position + state.length})"))
            seen.add(id(state))
            out.append((state, begin, n, row.start_position))
            begin += n
        return out

    def state_reaches(self, kv: SessionKV, start: int) -> bool:
        """Whether the session's next row may start at ``start`` without a rebuild: always for attention-only
        targets; for hybrid targets where its recurrent state reaches (:meth:`SessionState.reaches`)."""
        if not self.recurrent_layers:
            return True
        return start == 0 if kv.recurrent is None else kv.recurrent.reaches(start)

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
