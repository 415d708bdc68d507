"""The draft-head features of a session (:mod:`common.features`) on the verifier: a request checked against
the target, and the prompt's features collected by the prefill for the open answer. The verify rows' features
travel with their Work item (:class:`cloud_verifier.work.Work`) into the verdict
(:func:`cloud_verifier.verdict.stage.make_verdict`)."""

from __future__ import annotations

import numpy as np

from specdec_runtime.common.features import FeatureBlock, FeatureRequest, encode_features, resolve_layers

__all__ = ["resolve_request", "take_prompt_features"]


def resolve_request(features: FeatureRequest | None, num_hidden_layers: int) -> FeatureRequest | None:
    """``features`` with its layers in 0..num_hidden_layers (:func:`common.features.resolve_layers`), or None.

    Raises:
        InvalidRequestError: layers the target does not have, too many, or an unknown encoding."""
    if features is None:
        return None
    return FeatureRequest(tuple(resolve_layers(features, num_hidden_layers)), features.encoding)


def take_prompt_features(session) -> FeatureBlock | None:
    """The features the open's prefill kept (one vector per prefilled position, in order), encoded as the
    session asked; None when it asked for none (the open's prefill, or an ExtendSession turn's)."""
    request, session.prefill_features = session.prefill_features, None
    chunks, session.prefill_hidden = sorted(session.prefill_hidden, key=lambda c: c[0]), []
    if request is None:
        return None
    vectors = np.concatenate([h for _, h in chunks]) if chunks else np.zeros((0, 1), np.float32)
    return encode_features(vectors, chunks[0][0] if chunks else 0, request.encoding)
