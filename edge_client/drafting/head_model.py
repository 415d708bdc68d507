"""The device's draft head (:class:`OnnxHead`): one decoder layer conditioned on the target's features, run by
ONNX Runtime (CUDA EP when present, CPU otherwise), with its own KV cache. Made by ``specdec models export-head``
(the graph's signature: :mod:`specdec.models.head_graph`). numpy and onnxruntime only: the slim edge install.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from specdec_runtime.common.features import FLOAT16, FeatureRequest
from specdec_runtime.common.paths import ModelNotFoundError

__all__ = ["OnnxHead", "HEAD_FORMAT"]

log = logging.getLogger(__name__)
HEAD_FORMAT = "specdec-head/1"


def _providers(available: list[str]) -> list[str]:
    return (["CUDAExecutionProvider"] if "CUDAExecutionProvider" in available else []) + ["CPUExecutionProvider"]


def _session(path: Path, providers: list[str] | None, threads: int | None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # a co-located target keeps its cores
    if threads:
        so.intra_op_num_threads = int(threads)
    requested = list(providers) if providers is not None else _providers(ort.get_available_providers())
    try:
        return ort.InferenceSession(str(path), so, providers=requested)
    except Exception as exc:  # CUDA EP present but unusable: the CPU runs it
        if requested == ["CPUExecutionProvider"]:
            raise ModelNotFoundError(f"{path} is not a loadable ONNX model: {str(exc).splitlines()[0]}") from None
        log.warning("ONNX head: providers %s failed (%s); falling back to CPUExecutionProvider", requested, exc)
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


class OnnxHead:
    """A draft head directory: ``head.onnx``, ``head.json``, optional ``fuse.onnx`` (EAGLE-3's fc over the
    target's concatenated layers) and ``d2t.npy`` (the target id of each draft-vocabulary id), the tokenizer.

    Attributes:
        feature_request: the features the head reads (layers, float16 unless ``encoding`` says otherwise).
        vocab_size: the target's vocabulary (logits are scattered into it); draft_ids: int64 [draft_vocab], the
            target ids the head can propose (None: all, in order).
        num_cached: KV entries held.

    Raises:
        ModelNotFoundError: not a head directory (no head.json of this format, or an unloadable graph).
    """

    def __init__(self, head_dir: str | os.PathLike, providers: list[str] | None = None,
                 intra_op_num_threads: int | None = None, encoding: str = FLOAT16) -> None:
        from specdec_runtime.edge_client.drafting.tokenizer import load_tokenizer

        self.model_dir = Path(head_dir)
        meta_path = self.model_dir / "head.json"
        if not meta_path.is_file():
            raise ModelNotFoundError(f"{self.model_dir}: no head.json (make one with `specdec models export-head`)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != HEAD_FORMAT:
            raise ModelNotFoundError(f"{meta_path}: format {meta.get('format')!r}, expected {HEAD_FORMAT!r}")
        self.meta = meta
        self.session = _session(self.model_dir / "head.onnx", providers, intra_op_num_threads)
        self.providers = list(self.session.get_providers())
        fuse = self.model_dir / "fuse.onnx"
        self.fuse_session = _session(fuse, providers, intra_op_num_threads) if fuse.is_file() else None
        d2t = self.model_dir / "d2t.npy"
        self.draft_ids = np.load(d2t).astype(np.int64) if d2t.is_file() else None
        self.hidden_size = int(meta["hidden_size"])
        self.vocab_size = int(meta["target"]["vocab_size"])
        self.max_position_embeddings = int(meta.get("max_position_embeddings") or 0) or None
        self.feature_request = FeatureRequest(tuple(meta["feature_layers"]), encoding)
        self._kv_shape = (1, int(meta["num_key_value_heads"]), 0, int(meta["head_dim"]))
        self.tokenizer = load_tokenizer(self.model_dir)
        self.reset()

    @property
    def num_cached(self) -> int:
        return int(self._key.shape[2])

    def reset(self) -> None:
        """Forget the KV cache."""
        self._key = np.zeros(self._kv_shape, np.float32)
        self._value = np.zeros(self._kv_shape, np.float32)

    def rollback(self, num_entries: int) -> None:
        """Keep the first ``num_entries`` KV entries."""
        self._key, self._value = self._key[:, :, :num_entries], self._value[:, :, :num_entries]

    def fuse(self, target_features: np.ndarray) -> np.ndarray:
        """The head-width features [n, H] of the target's [n, target_feature_width] (EAGLE-3's fc; identity
        for a head that reads one layer)."""
        x = np.ascontiguousarray(target_features, dtype=np.float32)
        if self.fuse_session is None:
            return x
        return self.fuse_session.run(None, {"target_features": x})[0]

    def forward(self, token_ids: list[int], features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feed T entries (token, head-width feature [T, H]) after the cached ones: (logits float32
        [T, draft_vocab], the head's own features [T, H]); the KV cache grows by T."""
        start, t = self.num_cached, len(token_ids)
        feeds = {"input_ids": np.asarray([token_ids], np.int64),
                 "features": np.ascontiguousarray(features, np.float32).reshape(1, t, self.hidden_size),
                 "position_ids": np.arange(start, start + t, dtype=np.int64)[None],
                 "past_key": self._key, "past_value": self._value}
        logits, hidden, self._key, self._value = self.session.run(None, feeds)
        return logits[0], hidden[0]

    def full_vocab_logits(self, draft_logits: np.ndarray) -> np.ndarray:
        """float32 [vocab_size]: the draft-vocabulary logits at their target ids, -inf elsewhere (q = 0 outside
        the draft vocabulary, so the rejection rule stays exact)."""
        if self.draft_ids is None:
            return np.asarray(draft_logits, np.float32)
        out = np.full(self.vocab_size, -np.inf, np.float32)
        out[self.draft_ids] = draft_logits
        return out
