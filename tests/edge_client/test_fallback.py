"""edge_client.generation.fallback: the device decoder is the draft's own greedy decoding (the tiny draft carries
the target's weights: the target-only reference), seeded sampling is reproducible, drafters that cannot decode
alone are refused, and the cloud probe follows its backend's capabilities."""

from __future__ import annotations

import pytest

from conftest import PROMPT_IDS, PlainContext
from specdec_runtime.common.errors import UnsupportedByDrafterError
from specdec_runtime.common.types import SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.drafting.contract import DecodesAlone
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.ngram import NgramDrafter
from specdec_runtime.edge_client.generation.fallback import DeviceDecoder, cloud_probe_fn, decode_unverified
from specdec_runtime.edge_client.generation.routing import start_route
from specdec_runtime.edge_client.generation.run import Run
from specdec_runtime.edge_client.output import TextOutput


def _run(ctx, n: int) -> Run:
    stopping = StoppingCriteria(max_new_tokens=n, ignore_eos=True)
    return Run(list(PROMPT_IDS), stopping, TextOutput(ctx.tokenizer, ()), committed=list(PROMPT_IDS),
               route=start_route(ctx, "device"))


def test_device_decoding_is_the_drafts_own_decoding(room_local, room_draft, room_reference):
    drafter = ModelDrafter(room_draft, draft_top_k=4)
    assert isinstance(drafter, DecodesAlone) and DeviceDecoder.supports(drafter)
    ctx = PlainContext(room_local, drafter, room_draft.tokenizer)
    run = _run(ctx, 24)
    chunks = list(decode_unverified(ctx, run, SamplingParams()))
    assert run.committed[len(PROMPT_IDS):] == room_reference
    assert run.num_unverified == 24 and not any(c.verified for c in chunks) and run.finish_reason is not None
    sampled = SamplingParams(temperature=0.9, seed=11)
    a, b = _run(ctx, 12), _run(ctx, 12)
    list(decode_unverified(ctx, a, sampled))
    list(decode_unverified(ctx, b, sampled))
    assert a.committed == b.committed and len(a.committed) == len(PROMPT_IDS) + 12


def test_until_stops_after_one_token(room_local, room_draft, room_reference):
    ctx = PlainContext(room_local, ModelDrafter(room_draft), room_draft.tokenizer)
    run = _run(ctx, 24)
    list(decode_unverified(ctx, run, SamplingParams(), until=lambda: True))
    assert run.committed[len(PROMPT_IDS):] == room_reference[:1] and run.finish_reason is None


@pytest.mark.parametrize("drafter", [None, NgramDrafter()], ids=["none", "ngram"])
def test_drafters_that_cannot_decode_alone(drafter):
    assert not DeviceDecoder.supports(drafter)
    with pytest.raises(UnsupportedByDrafterError):
        DeviceDecoder(drafter)


def test_cloud_probe_follows_the_backends_capabilities(room_local, room_address):
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    assert cloud_probe_fn(room_local, 0.1)()  # no probe, no health check: "answers" (the next open is the test)
    backend = GrpcBackend(room_address)
    probe = cloud_probe_fn(backend, 0.1)
    assert probe()
    backend.close()
    assert not probe()  # its health check answers False once closed
