"""Real small parts for the unit tests of the edge loop's rooms (test_<room>.py): the tiny target served in
process (LocalBackend) and over loopback gRPC, the tiny ONNX draft (the target's own weights: its greedy output is
the target's), a plain GenerationContext, and the target-only reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

PROMPT_IDS = [1, 504, 3458, 28, 9, 77, 4052, 311, 17, 905, 42, 6]


@dataclass
class PlainContext:
    """A GenerationContext (edge_client.generation.context) with EdgeClient's defaults, built without the client:
    what the loop's modules read, and nothing else."""

    backend: object
    drafter: object
    tokenizer: object
    fingerprint: str = ""
    num_speculative_tokens: int = 3
    adaptive: bool = False
    min_confidence: float = 0.0
    proactive: bool = False
    bonus_drafted: bool | None = None
    timeout_s: float = 60.0
    open_timeout_s: float = 60.0
    fallback: str = "none"
    reconnect_interval_s: float = 0.2
    device_drafter: object = None
    route: str = "speculative"
    route_estimates: object = None
    route_switcher: object = None
    last_result: object = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from specdec_runtime.edge_client.generation.route_cost import RouteEstimates

        self.route_estimates = self.route_estimates or RouteEstimates()


@pytest.fixture(scope="session")
def room_verifier(tiny_pair):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    return Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=0.0)


@pytest.fixture(scope="session")
def room_local(room_verifier):
    """The tiny target in process (specdec.embedded.LocalBackend): no network."""
    from specdec.embedded import LocalBackend

    backend = LocalBackend(room_verifier)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def room_address(tiny_pair):
    """A real verifier gRPC server of the tiny target on loopback (its own Verifier)."""
    from specdec.embedded import EmbeddedServer
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=0.0)
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        yield address


@pytest.fixture(scope="session")
def room_draft(tiny_pair):
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    return OnnxDraftModel(tiny_pair.draft_dir)


@pytest.fixture(scope="session")
def room_reference(tiny_pair):
    """Target-only greedy continuation of PROMPT_IDS (plain HF generate), 24 tokens."""
    from _reference import hf_greedy

    return hf_greedy(tiny_pair.target_dir, PROMPT_IDS, 24)
