"""ONNX Runtime runner of the draft model, with its KV cache kept on the device between calls.

The model directory is the output of :func:`specdec.models.export_onnx_draft` (text-generation-with-past
layout: ``input_ids``, ``attention_mask``, optional ``position_ids`` (absent from ONNX Runtime GenAI builder
graphs), ``past_key_values.{i}.key/.value`` in; ``logits``, ``present.{i}.key/.value`` out; matched by name,
in any order), with the tokenizer and ``config.json`` beside ``model.onnx``. Batch size is 1 (one session per
runner).
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import numpy as np

from specdec_runtime.common.paths import ONNX_FILE, ModelNotFoundError, resolve_draft_dir

log = logging.getLogger(__name__)

__all__ = ["OnnxDraftModel"]

_PAST_RE = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT_RE = re.compile(r"^present\.(\d+)\.(key|value)$")
_ORT_NP_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}
# shared KV buffer mode: the providers it runs on, and where their buffers live (None: numpy, else an ORT device)
_SHARED_KV_PROVIDERS: dict[str, str | None] = {"CPUExecutionProvider": None, "CUDAExecutionProvider": "cuda"}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _default_providers(available: list[str]) -> list[str]:
    providers = []
    if "CUDAExecutionProvider" in available:
        providers.append("CUDAExecutionProvider")
    providers.append("CPUExecutionProvider")
    return providers


def _dims(buffer: Any) -> tuple[int, ...]:
    """Shape of a shared KV buffer (numpy array or OrtValue)."""
    return tuple(buffer.shape) if isinstance(buffer, np.ndarray) else tuple(buffer.shape())


class OnnxDraftModel:
    """Draft causal LM in ONNX Runtime holding the KV cache of the tokens fed so far (batch 1).

    Not thread-safe: the KV cache (and its IOBinding buffers) belong to one generation at a time, so two threads
    drafting through one instance corrupt each other's cache. Give each concurrent generation its own instance
    (the ONNX Runtime session's weights are read-only, but this class holds one session per instance), or
    serialise the generations as ``edge-serve`` does (one worker thread per EdgeClient).

    Args:
        model_dir: ONNX draft directory (``model.onnx`` + tokenizer + ``config.json``).
        providers: ONNX Runtime execution providers; None = ``CUDAExecutionProvider`` when this onnxruntime
            build has it, then ``CPUExecutionProvider`` (falls back to CPU alone if the CUDA session cannot be
            created). The providers in use are logged and kept in ``self.providers``.
        intra_op_num_threads: ORT intra-op threads; None = ORT's default (one per physical core).
        allow_spinning: let idle ORT worker threads spin (lower latency on a dedicated device; off by default).
        share_kv_buffer: keep the KV cache in preallocated buffers that GroupQueryAttention updates in place
            (ONNX Runtime's past/present buffer sharing through IOBinding): no per-step copy of the whole cache
            into new ``present`` arrays and O(1) rollback. None (default) = on for GenAI-builder graphs (no
            ``position_ids`` input: fused GroupQueryAttention) on the CPU or the CUDA provider; off otherwise.
            Measured on the SmolLM2-135M draft, one core: one-token forward 8.6 vs 9.1 ms after 60 cached
            tokens, 11.5 vs 16.8 ms after 700 (forward + rollback), identical logits. On the CUDA provider the
            buffers are device memory (ORT-allocated OrtValues): the cache never crosses PCIe, only the token
            ids go in and the logits come out; growing the buffers (doubling, rare) copies through the host.

    Attributes:
        vocab_size: width of the logits (may exceed ``len(tokenizer)`` when embeddings are padded).
        tokenizer: the tokenizer saved with the draft (:class:`edge_client.drafting.tokenizer.EdgeTokenizer`).
        num_cached: tokens whose keys/values are held (the next token fed gets position ``num_cached``).
        num_layers, num_kv_heads, head_dim: KV-cache geometry read from the session's inputs.
        max_position_embeddings: the draft's context length from config.json (None when unknown).

    Raises:
        ModelNotFoundError (a ValueError): ``model_dir`` holds no ONNX draft, the file is not a loadable ONNX
            model, lacks the expected inputs/outputs, or config.json lacks the KV-cache geometry.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        providers: list[str] | None = None,
        intra_op_num_threads: int | None = None,
        allow_spinning: bool = False,
        share_kv_buffer: bool | None = None,
    ) -> None:
        import onnxruntime as ort

        from specdec_runtime.edge_client.drafting.tokenizer import load_tokenizer

        self.model_dir = resolve_draft_dir(model_dir)
        path = self.model_dir / ONNX_FILE
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        if intra_op_num_threads:
            so.intra_op_num_threads = int(intra_op_num_threads)
        if not allow_spinning:  # idle ORT threads would busy-wait and slow a co-located target down
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        requested = list(providers) if providers is not None else _default_providers(ort.get_available_providers())
        try:
            try:
                self.session = ort.InferenceSession(str(path), so, providers=requested)
            except Exception as exc:  # e.g. CUDA EP present but no usable GPU / CUDA libraries
                if requested == ["CPUExecutionProvider"]:
                    raise
                log.warning("ONNX draft: providers %s failed (%s); falling back to CPUExecutionProvider",
                            requested, exc)
                self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # corrupt or foreign file: one clear line, not ORT's traceback
            raise ModelNotFoundError(f"{path} is not a loadable ONNX model: {_first_line(exc)}") from None
        self.providers: list[str] = list(self.session.get_providers())
        if "CUDAExecutionProvider" in requested and "CUDAExecutionProvider" not in self.providers:
            log.warning("ONNX draft: CUDAExecutionProvider unavailable, running on %s", self.providers)
        log.info("ONNX draft %s on %s", self.model_dir, self.providers)

        self._config = self._read_config()
        try:
            self._parse_io()
        except KeyError as exc:
            raise ModelNotFoundError(
                f"{self.model_dir}: config.json lacks {exc} (needed for the KV-cache geometry)"
            ) from None
        self.max_position_embeddings: int | None = self._config.get("max_position_embeddings")
        # tokenizers + the directory's files, not transformers: an edge install has no torch/transformers
        self.tokenizer = load_tokenizer(self.model_dir)
        if share_kv_buffer is None:
            share_kv_buffer = not self._has_position_ids and self.providers[0] in _SHARED_KV_PROVIDERS
        # where shared KV buffers live: None = numpy arrays (bound as views, the CPU provider), else the ORT device
        # ("cuda") of ORT-allocated buffers
        self._kv_device: str | None = _SHARED_KV_PROVIDERS.get(self.providers[0])
        if share_kv_buffer and self._has_position_ids:
            raise ValueError("share_kv_buffer needs a GroupQueryAttention graph (no position_ids input)")
        self.share_kv_buffer = bool(share_kv_buffer)
        self._buffers: list[Any] = []  # shared mode: [2L] numpy arrays / device OrtValues [1, kv_heads, capacity, head_dim]
        self._binding: Any = None  # shared mode: IOBinding with the buffers bound as past and present
        self._device_kv_checked = False  # a forward on device KV buffers has succeeded
        vocab = self._logits_width()
        self.vocab_size: int = vocab if vocab is not None else self._probe_vocab_size()
        self.reset()

    # ------------------------------------------------------------------------------------------ setup

    def _parse_io(self) -> None:
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        for name in ("input_ids", "attention_mask"):
            if name not in inputs:
                raise ModelNotFoundError(
                    f"{self.model_dir / ONNX_FILE} has no input {name!r} (not a text-generation-with-past export)"
                )
        if "logits" not in outputs:
            raise ModelNotFoundError(f"{self.model_dir / ONNX_FILE} has no output 'logits'")
        # position_ids is optional: graphs with fused attention (ORT GroupQueryAttention, as built by
        # onnxruntime-genai's model builder) derive positions from attention_mask.
        self._has_position_ids = "position_ids" in inputs
        past = {}
        for name in inputs:
            m = _PAST_RE.match(name)
            if m:
                past[(int(m.group(1)), m.group(2))] = name
        present = {}
        for name in outputs:
            m = _PRESENT_RE.match(name)
            if m:
                present[(int(m.group(1)), m.group(2))] = name
        self.num_layers = len({k[0] for k in past})
        keys = [(i, kind) for i in range(self.num_layers) for kind in ("key", "value")]
        if self.num_layers == 0 or any(k not in past or k not in present for k in keys):
            raise ModelNotFoundError(
                f"{self.model_dir / ONNX_FILE}: past_key_values.{{i}}.key/value inputs and present.{{i}}.key/value "
                "outputs must cover layers 0..L-1"
            )
        self._past_names = [past[k] for k in keys]  # [2L] in layer order, key then value
        self._output_names = ["logits"] + [present[k] for k in keys]
        first = inputs[self._past_names[0]]
        shape = first.shape  # [batch, num_kv_heads, past, head_dim]; dims may be symbolic (str)
        self._kv_dtype = _ORT_NP_DTYPES.get(first.type, np.float32)
        cfg = self._config
        heads = cfg.get("num_attention_heads")
        kv_heads = shape[1] if isinstance(shape[1], int) else cfg.get("num_key_value_heads") or heads
        head_dim = shape[3] if isinstance(shape[3], int) else cfg.get("head_dim") or (cfg["hidden_size"] // heads)
        self.num_kv_heads, self.head_dim = int(kv_heads), int(head_dim)
        logits_shape = self.session.get_outputs()[0].shape
        self._static_vocab = logits_shape[-1] if isinstance(logits_shape[-1], int) else None

    def _read_config(self) -> dict[str, Any]:
        path = self.model_dir / "config.json"
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except ValueError as exc:
            raise ModelNotFoundError(f"{path} is not valid JSON: {exc}") from None

    def _logits_width(self) -> int | None:
        if self._static_vocab is not None:
            return self._static_vocab
        return self._config.get("vocab_size")

    def _probe_vocab_size(self) -> int:
        self.reset()
        width = int(self.forward([0]).shape[-1])
        self.reset()
        return width

    # ------------------------------------------------------------------------------------------ API

    def reset(self) -> None:
        """Drop the whole KV cache (``num_cached`` = 0)."""
        empty = np.zeros((1, self.num_kv_heads, 0, self.head_dim), dtype=self._kv_dtype)
        self._past: list[np.ndarray] = [empty] * (2 * self.num_layers)
        self.num_cached = 0  # shared mode: buffers are kept; positions >= num_cached are stale and never read

    def forward(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Feed ``token_ids`` at positions ``num_cached ..`` and append their keys/values to the cache.

        Args:
            token_ids: n >= 1 token ids.

        Returns:
            logits: float32 [n, vocab_size]; row j is the draft's next-token logits after token j.

        Raises:
            ValueError: empty ``token_ids``, an id outside [0, vocab_size), or more positions than the draft's
                context (``max_position_embeddings``).
        """
        ids = np.asarray(token_ids, dtype=np.int64).reshape(1, -1)
        n = ids.shape[1]
        if n == 0:
            raise ValueError("forward needs at least one token id")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size}): {ids.min()}..{ids.max()}")
        start = self.num_cached
        if self.max_position_embeddings and start + n > self.max_position_embeddings:
            raise ValueError(
                f"{start} cached + {n} new tokens exceed the draft's context of {self.max_position_embeddings} tokens"
            )
        if self.share_kv_buffer and self._kv_device is not None and not self._device_kv_checked:
            try:  # the first forward on device buffers: if the provider cannot run them, carry on without
                logits = self._forward_shared(ids, start, n)
                self._device_kv_checked = True
                return logits
            except Exception as exc:  # noqa: BLE001 - any ORT failure: fall back to per-step present arrays
                log.warning("ONNX draft: KV buffers on %s failed (%s); falling back to host KV arrays",
                            self._kv_device, _first_line(exc))
                self._leave_shared_mode(start)
        if self.share_kv_buffer:
            return self._forward_shared(ids, start, n)
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, start + n), dtype=np.int64)}
        if self._has_position_ids:
            feeds["position_ids"] = np.arange(start, start + n, dtype=np.int64).reshape(1, n)
        feeds.update(zip(self._past_names, self._past))
        outs = self.session.run(self._output_names, feeds)
        self._past = outs[1:]  # present.* become the next past_key_values.* (no copy)
        self.num_cached = start + n
        return outs[0][0]

    def rollback(self, length: int) -> None:
        """Keep the keys/values of the first ``length`` tokens only (0 <= length <= num_cached).

        Raises:
            ValueError: ``length`` outside [0, num_cached].
        """
        if not 0 <= length <= self.num_cached:
            raise ValueError(f"rollback length must be in [0, {self.num_cached}], got {length}")
        if length == self.num_cached:
            return
        if length == 0:
            self.reset()
            return
        if self.share_kv_buffer:  # GroupQueryAttention reads positions < attention_mask length only
            self.num_cached = length
            return
        # One contiguous copy per tensor (ORT needs contiguous inputs; [1, H, T, D] sliced on T is not).
        self._past = [np.ascontiguousarray(t[:, :, :length]) for t in self._past]
        self.num_cached = length

    def snapshot(self, length: int) -> list[np.ndarray]:
        """Host copies of the keys/values of the first ``length`` cached tokens: [2L] arrays [1, kv_heads, length,
        head_dim] in layer order, key then value (for :meth:`restore`; the draft's prefix cache).

        Raises:
            ValueError: ``length`` outside [1, num_cached]."""
        if not 0 < length <= self.num_cached:
            raise ValueError(f"snapshot length must be in [1, {self.num_cached}], got {length}")
        if not self.share_kv_buffer:
            return [np.array(t[:, :, :length]) for t in self._past]
        return [np.array((b if isinstance(b, np.ndarray) else b.numpy())[:, :, :length]) for b in self._buffers]

    def restore(self, kv: list[np.ndarray]) -> None:
        """Replace the cache with ``kv`` (:meth:`snapshot`'s arrays, or a prefix of them along the token axis):
        ``num_cached`` becomes their length.

        Raises:
            ValueError: not 2 × num_layers arrays of this draft's KV geometry."""
        shape = (1, self.num_kv_heads, self.head_dim)
        if len(kv) != 2 * self.num_layers or any((t.shape[0], t.shape[1], t.shape[3]) != shape for t in kv):
            raise ValueError(f"restore needs {2 * self.num_layers} arrays [1, {self.num_kv_heads}, n, "
                             f"{self.head_dim}]")
        n = int(kv[0].shape[2])
        self.reset()
        if not self.share_kv_buffer:
            self._past = [np.ascontiguousarray(t, dtype=self._kv_dtype) for t in kv]
        else:
            self._ensure_capacity(n)
            for buf, t in zip(self._buffers, kv):
                if isinstance(buf, np.ndarray):
                    buf[:, :, :n] = t
                else:  # device memory: through the host, as a growth does
                    host = buf.numpy()
                    host[:, :, :n] = t
                    buf.update_inplace(host)
        self.num_cached = n

    # ------------------------------------------------------------------------------------------ shared KV

    def _ensure_capacity(self, total: int) -> None:
        """Grow the shared KV buffers (doubling, at least 256 positions) to hold ``total`` positions."""
        import onnxruntime as ort

        capacity = _dims(self._buffers[0])[2] if self._buffers else 0
        if total <= capacity:
            return
        new_capacity = max(256, capacity)
        while new_capacity < total:
            new_capacity *= 2
        if self.max_position_embeddings:  # no position past the model's context is ever fed
            new_capacity = max(total, min(new_capacity, int(self.max_position_embeddings)))
        shape = (1, self.num_kv_heads, new_capacity, self.head_dim)
        buffers = []
        for old in self._buffers or [None] * (2 * self.num_layers):
            if self._kv_device is None:
                buf = np.zeros(shape, dtype=self._kv_dtype)
                if old is not None and self.num_cached:
                    buf[:, :, : self.num_cached] = old[:, :, : self.num_cached]
            else:  # ORT-allocated device memory: the kept positions travel through the host once per growth
                host = np.zeros(shape, dtype=self._kv_dtype)
                if old is not None and self.num_cached:
                    host[:, :, : self.num_cached] = old.numpy()[:, :, : self.num_cached]
                buf = ort.OrtValue.ortvalue_from_shape_and_type(shape, self._kv_dtype, self._kv_device, 0)
                buf.update_inplace(host)
            buffers.append(buf)
        self._buffers = buffers
        io = self.session.io_binding()  # KV bound once per growth; forward() rebinds the tokens and logits
        for past_name, present_name, buf in zip(self._past_names, self._output_names[1:], buffers):
            # numpy: a view of the host buffer, no copy; device: the OrtValue itself
            value = ort.OrtValue.ortvalue_from_numpy(buf) if isinstance(buf, np.ndarray) else buf
            io.bind_ortvalue_input(past_name, value)
            io.bind_ortvalue_output(present_name, value)
        io.bind_output("logits")  # bound last: get_outputs()[-1], the same slot when rebound
        self._binding = io

    def _leave_shared_mode(self, keep: int) -> None:
        """Switch to per-step ``present`` arrays, keeping the first ``keep`` cached positions."""
        past = []
        for buf in self._buffers or [None] * (2 * self.num_layers):
            host = buf if isinstance(buf, np.ndarray) else (buf.numpy() if buf is not None else None)
            past.append(np.ascontiguousarray(host[:, :, :keep]) if host is not None and keep else
                        np.zeros((1, self.num_kv_heads, 0, self.head_dim), dtype=self._kv_dtype))
        self.share_kv_buffer = False
        self._buffers, self._binding = [], None
        self._past = past
        self.num_cached = keep

    def _forward_shared(self, ids: np.ndarray, start: int, n: int) -> np.ndarray:
        """forward() with past_key_values.* and present.* bound to the same preallocated buffers: the
        GroupQueryAttention kernel appends the new keys/values in place (past/present buffer sharing)."""
        self._ensure_capacity(start + n)
        io = self._binding
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("attention_mask", np.ones((1, start + n), dtype=np.int64))
        io.bind_output("logits")  # unallocated: its shape [1, n, vocab] changes from call to call
        self.session.run_with_iobinding(io)
        logits = io.get_outputs()[-1].numpy()
        self.num_cached = start + n
        return logits[0]

    def __repr__(self) -> str:
        return (
            f"OnnxDraftModel({str(self.model_dir)!r}, layers={self.num_layers}, vocab={self.vocab_size}, "
            f"providers={self.providers}, num_cached={self.num_cached})"
        )
