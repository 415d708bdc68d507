"""Adaptive verification: how much of each queued draft block a batch step verifies (the verify-length policy
of :class:`cloud_verifier.batcher.Batcher`; docs/verification.md)."""

from specdec_runtime.cloud_verifier.verify_policy.calibration import AcceptanceCalibration
from specdec_runtime.cloud_verifier.verify_policy.cost import ForwardCostModel, profile_forward
from specdec_runtime.cloud_verifier.verify_policy.cost_table import CostTableCache
from specdec_runtime.cloud_verifier.verify_policy.profiler import CostProfiler
from specdec_runtime.cloud_verifier.verify_policy.policy import (
    VERIFY_POLICIES,
    AdaptiveVerifyPolicy,
    VerifyPolicy,
    draft_confidences,
    make_verify_policy,
    set_verify_lengths,
    truncate_block,
)

__all__ = ["VERIFY_POLICIES", "AcceptanceCalibration", "AdaptiveVerifyPolicy", "CostProfiler", "CostTableCache",
           "ForwardCostModel", "VerifyPolicy", "draft_confidences", "make_verify_policy", "profile_forward",
           "set_verify_lengths", "truncate_block"]
