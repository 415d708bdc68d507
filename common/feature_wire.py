"""Wire form of the target's features (specdec.v1.FeatureRequest / FeatureBlock) and :mod:`common.features`.

Every feature field of the existing messages is field 30 and unset unless a session asks: a client that never
asks sends and receives exactly the bytes it did before features existed (tests/common/test_feature_wire.py).
"""

from __future__ import annotations

import numpy as np

from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.features import FLOAT16, INT8, FeatureBlock, FeatureRequest
from specdec_runtime.common.v1 import verifier_pb2 as pb

__all__ = ["feature_request_to_proto", "feature_request_from_proto", "feature_block_to_proto",
           "feature_block_from_proto"]

_ENCODING_TO_PROTO = {FLOAT16: pb.FeatureRequest.FLOAT16, INT8: pb.FeatureRequest.INT8}
_ENCODING_FROM_PROTO = {v: k for k, v in _ENCODING_TO_PROTO.items()}


def _encoding_from_proto(value: int) -> str:
    if value not in _ENCODING_FROM_PROTO:
        raise InvalidRequestError(f"features: unknown encoding {value}")
    return _ENCODING_FROM_PROTO[value]


def feature_request_to_proto(request: FeatureRequest) -> pb.FeatureRequest:
    """Raises InvalidRequestError: an unknown encoding."""
    if request.encoding not in _ENCODING_TO_PROTO:
        raise InvalidRequestError(f"features: unknown encoding {request.encoding!r} (float16 | int8)")
    return pb.FeatureRequest(layers=[int(i) for i in request.layers], encoding=_ENCODING_TO_PROTO[request.encoding])


def feature_request_from_proto(msg: pb.FeatureRequest) -> FeatureRequest:
    """Raises InvalidRequestError: an unknown encoding (layer ranges are the verifier's check)."""
    return FeatureRequest(tuple(int(i) for i in msg.layers), _encoding_from_proto(msg.encoding))


def feature_block_to_proto(block: FeatureBlock) -> pb.FeatureBlock:
    msg = pb.FeatureBlock(start_position=int(block.start_position), num_positions=int(block.num_positions),
                          width=int(block.width), encoding=_ENCODING_TO_PROTO[block.encoding], data=block.data)
    if block.scales is not None:
        msg.scales.extend(float(s) for s in block.scales)
    return msg


def feature_block_from_proto(msg: pb.FeatureBlock) -> FeatureBlock:
    """Raises InvalidRequestError: an unknown encoding, or sizes that do not match (checked by decoding)."""
    encoding = _encoding_from_proto(msg.encoding)
    scales = np.asarray(msg.scales, dtype=np.float32) if encoding == INT8 else None
    block = FeatureBlock(int(msg.start_position), int(msg.width), encoding, bytes(msg.data), int(msg.num_positions),
                         scales)
    if block.num_positions < 0 or block.width <= 0 or block.start_position < 0:
        raise InvalidRequestError("feature block: negative position or count, or no width")
    block.decode()  # size check
    return block
