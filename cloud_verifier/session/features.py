"""The draft-head features of a session (:mod:`common.features`) on the verifier: a request checked against
the target, the prompt's features collected by the prefill for the open answer, and the features a resume's
re-prefill recomputed for a client that lacks them (``DraftBlock.features_from``). The verify rows' features
travel with their Work item (:class:`cloud_verifier.work.Work`) into the verdict (:func:`verdict_features`,
called by :func:`cloud_verifier.verdict.stage.make_verdict`).

Resume. A session resumed here for a block that says ``features_from`` P (a draft head after a failover) is
re-prefilled with its features kept: positions P .. committed_length − 2 of the stored committed ids, the
positions whose verdicts the client may have lost (read back from the store, which keeps no features). The
session's next verdict takes them (:func:`verdict_features`): when its block says ``features_from`` too, they
come before the verify pass's own, in one FeatureBlock from P; whatever block it is, they are dropped then.
No extra forward pass: the re-prefill runs anyway, it only skips the prefix cache (cached pages have no
features)."""

from __future__ import annotations

import numpy as np

from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.features import FeatureBlock, FeatureRequest, encode_features, resolve_layers

__all__ = ["check_features_from", "keep_resumed_features", "resolve_request", "take_prompt_features",
           "verdict_features"]


def resolve_request(features: FeatureRequest | None, num_hidden_layers: int) -> FeatureRequest | None:
    """``features`` with its layers in 0..num_hidden_layers (:func:`common.features.resolve_layers`), or None.

    Raises:
        InvalidRequestError: layers the target does not have, too many, or an unknown encoding."""
    if features is None:
        return None
    return FeatureRequest(tuple(resolve_layers(features, num_hidden_layers)), features.encoding)


def take_prompt_features(session, features_from: int | None = None) -> FeatureBlock | None:
    """The features the open's prefill kept (one vector per prefilled position, in order), encoded as the
    session asked; None when it asked for none (the open's prefill, or an ExtendSession turn's). An
    ExtendSession that says ``features_from`` gets the session's resumed features before them, as a verdict
    would (:func:`verdict_features`); they are dropped either way."""
    request, session.prefill_features = session.prefill_features, None
    chunks, session.prefill_hidden = sorted(session.prefill_hidden, key=lambda c: c[0]), []
    resumed, session.resumed_features = session.resumed_features, None
    if request is None:
        return None
    vectors = np.concatenate([h for _, h in chunks]) if chunks else np.zeros((0, 1), np.float32)
    start = chunks[0][0] if chunks else 0
    if chunks and features_from is not None:
        vectors, start = _after_resumed(resumed, request, vectors, start)
    return encode_features(vectors, start, request.encoding)


def check_features_from(features, start: int | None, committed_length: int) -> None:
    """A request's ``features_from`` (``start``: a DraftBlock's, DecodeRequest's or ExtendSessionRequest's) is
    unset, or asked with ``features`` (a FeatureRequest) and within 0 .. ``committed_length`` − 1 (the positions
    before the request's own features).

    Raises:
        InvalidRequestError: features_from without features, or out of that range."""
    if start is None:
        return
    if features is None:
        raise InvalidRequestError("features_from needs features (the FeatureRequest its vectors follow)")
    if not 0 <= start <= committed_length - 1:
        raise InvalidRequestError(f"features_from {start} outside 0..{committed_length - 1} (the committed length "
                                  f"- 1)")


def keep_resumed_features(session, features_from: int) -> None:
    """After a resume's re-prefill that kept its features (``session.prefill_features`` set): keep those of
    positions ``features_from`` .. (float32 [n, width], with the request's layers) in ``session.resumed_features``
    for the next verdict (:func:`verdict_features`), and clear what the prefill collected."""
    request, session.prefill_features = session.prefill_features, None
    chunks, session.prefill_hidden = sorted(session.prefill_hidden, key=lambda c: c[0]), []
    if request is None or not chunks:
        return
    vectors = np.concatenate([h for _, h in chunks])
    first = max(int(features_from) - chunks[0][0], 0)
    session.resumed_features = (tuple(request.layers), chunks[0][0] + first, vectors[first:])


def verdict_features(work, num_committed: int) -> FeatureBlock | None:
    """The ``Verdict.features`` of a verify row (a :class:`cloud_verifier.work.Work` whose forward kept its
    tokens' features in ``work.hidden``, float32 [len(tokens), width]): the first ``num_committed`` rows, from
    ``work.start_position``; preceded by the session's resumed features when the block says ``features_from``,
    asks for the same layers, and they end right before the row's own (then the block starts at the first of
    them, at most ``features_from``). The session's resumed features are dropped either way. None when the block
    asked for none."""
    resumed, work.session.resumed_features = work.session.resumed_features, None
    if getattr(work, "hidden", None) is None:
        return None
    request = work.full_block.features
    vectors, start = work.hidden[:num_committed], work.start_position
    if work.full_block.features_from is not None:
        vectors, start = _after_resumed(resumed, request, vectors, start)
    return encode_features(vectors, start, request.encoding)


def _after_resumed(resumed: tuple | None, request: FeatureRequest, vectors: np.ndarray,
                   start: int) -> tuple[np.ndarray, int]:
    """(vectors, start) preceded by the ``resumed`` features (layers, first position, float32 [n, width]) when
    they were kept for the same layers and end right before ``start``; else as they are."""
    if resumed is None:
        return vectors, start
    layers, first, kept = resumed
    if layers != tuple(request.layers) or first + len(kept) != start or not len(kept):
        return vectors, start
    return np.concatenate([kept, vectors]), first
