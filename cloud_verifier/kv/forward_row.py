"""What one row of a forward pass of the target asks for (:class:`ForwardRow`): the input of
:meth:`cloud_verifier.target.runner.TargetRunner.forward`, built by the batcher's KV scheduler and the self-check.

Its own module so that whatever builds rows (the scheduler, the architecture self-check, the benches) needs
neither the runner nor the model behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec_runtime.cloud_verifier.kv.pool import SessionKV


@dataclass
class ForwardRow:
    """One row of a ragged batch.

    token_ids: tokens fed at positions start_position .. start_position + len - 1; their keys/values are written
        into ``kv`` at those positions, and they attend to kv[:start_position] plus each other (causally).
    logits: which of the row's positions need logits: "all", "last", "none" (prefill), or an int k: the last k
        (a verify row behind the positions a preempted session recomputes).
    feature_layers / hidden: the target's features asked for the row, and the runner's answer (below).
    """

    kv: SessionKV
    token_ids: list[int]
    start_position: int
    logits: str | int = "all"
    # draft-head features (common.features): the layer indices whose hidden states the forward pass keeps for
    # every position of the row, concatenated; None: none. The runner sets ``hidden`` (float32 numpy
    # [len(token_ids), len(feature_layers) x hidden_size]) when asked.
    feature_layers: tuple[int, ...] | None = None
    hidden: object = None
