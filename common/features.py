"""The target's features on the wire: what a draft head asks for (:class:`FeatureRequest`) and the vectors the
verifier sends back (:class:`FeatureBlock`), with their encodings (float16; int8 with one scale per vector).

A draft head in the EAGLE family (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"; Li et al. 2025, "EAGLE-3") drafts the token after position t from the target's hidden state at t.
The verifier computes those hidden states in every forward pass it runs anyway; a session that asks gets one
vector per committed position. The vector is the concatenation of the hidden states at ``layers`` (numbered as the
inputs of decoder layers: 0 the embeddings, i the input of layer i, ``num_hidden_layers`` or -1 the final normed
state). The fusion of several layers (EAGLE-3's ``fc``) is the head's, on the device: the verifier needs no
weights of any head, so any head trained for the target works with any verifier of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec_runtime.common.errors import InvalidRequestError

__all__ = ["FLOAT16", "INT8", "MAX_FEATURE_LAYERS", "FeatureRequest", "FeatureBlock", "encode_features",
           "resolve_layers"]

FLOAT16 = "float16"
INT8 = "int8"
MAX_FEATURE_LAYERS = 4  # EAGLE-3 uses three; a bound keeps one request from asking for the whole model


@dataclass(frozen=True)
class FeatureRequest:
    """The features a session asks for. ``layers``: hidden-state indices (see the module docstring), in the
    order they are concatenated; ``encoding``: "float16" | "int8"."""

    layers: tuple[int, ...] = (-1,)
    encoding: str = FLOAT16


@dataclass
class FeatureBlock:
    """Feature vectors of positions ``start_position`` .. ``start_position + len(vectors) - 1``.

    ``vectors``: float32 [num_positions, width] once decoded (:meth:`decode`); on the wire float16 values, or int8
    values with one float32 scale per row (``scales``)."""

    start_position: int
    width: int
    encoding: str
    data: bytes
    num_positions: int
    scales: np.ndarray | None = None  # float32 [num_positions], INT8 only

    def decode(self) -> np.ndarray:
        """float32 [num_positions, width].

        Raises:
            InvalidRequestError: data or scales of the wrong size."""
        n, w = self.num_positions, self.width
        if self.encoding == FLOAT16:
            if len(self.data) != n * w * 2:
                raise InvalidRequestError(f"feature block: {len(self.data)} bytes for {n} x {w} float16")
            return np.frombuffer(self.data, dtype="<f2").reshape(n, w).astype(np.float32)
        if len(self.data) != n * w or self.scales is None or len(self.scales) != n:
            raise InvalidRequestError(f"feature block: {len(self.data)} bytes / {0 if self.scales is None else len(self.scales)}"
                                      f" scales for {n} x {w} int8")
        q = np.frombuffer(self.data, dtype=np.int8).reshape(n, w).astype(np.float32)
        return q * np.asarray(self.scales, dtype=np.float32)[:, None]

    @property
    def nbytes(self) -> int:
        """Payload bytes (values + scales), without protobuf framing."""
        return len(self.data) + (0 if self.scales is None else 4 * len(self.scales))


def encode_features(vectors: np.ndarray, start_position: int, encoding: str) -> FeatureBlock:
    """Encode float [num_positions, width] feature vectors. int8: symmetric, scale = max|x| / 127 per row (a
    zero row gets scale 0), rounding to nearest.

    Raises:
        InvalidRequestError: an unknown encoding."""
    x = np.asarray(vectors, dtype=np.float32)
    n, w = x.shape
    if encoding == FLOAT16:
        return FeatureBlock(start_position, w, encoding, x.astype("<f2").tobytes(), n)
    if encoding != INT8:
        raise InvalidRequestError(f"unknown feature encoding {encoding!r} (float16 | int8)")
    scales = np.abs(x).max(axis=1) / 127.0 if n else np.zeros(0, np.float32)
    safe = np.where(scales > 0, scales, 1.0)
    q = np.clip(np.rint(x / safe[:, None]), -127, 127).astype(np.int8)
    return FeatureBlock(start_position, w, encoding, q.tobytes(), n, scales.astype(np.float32))


def resolve_layers(request: FeatureRequest, num_hidden_layers: int) -> list[int]:
    """The request's layer indices in 0..num_hidden_layers (-1 → num_hidden_layers).

    Raises:
        InvalidRequestError: no layer, more than MAX_FEATURE_LAYERS, or an index out of range."""
    layers = list(request.layers)
    if not 1 <= len(layers) <= MAX_FEATURE_LAYERS:
        raise InvalidRequestError(f"features: 1 to {MAX_FEATURE_LAYERS} layers, got {len(layers)}")
    out = [num_hidden_layers if i == -1 else int(i) for i in layers]
    bad = [i for i in out if not 0 <= i <= num_hidden_layers]
    if bad:
        raise InvalidRequestError(f"features: layer {bad[0]} outside 0..{num_hidden_layers} (or -1)")
    if request.encoding not in (FLOAT16, INT8):
        raise InvalidRequestError(f"features: unknown encoding {request.encoding!r} (float16 | int8)")
    return out
