"""The seed on the wire: ``optional uint64 seed`` (unset: the verifier picks one), with the deprecated
``has_seed`` still written and read so that peers from before the field was optional understand every seed —
0 included, which such a peer leaves off the wire."""

from __future__ import annotations

import pytest

from specdec_runtime.common.types import SamplingParams
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.wire import sampling_from_proto, sampling_to_proto


@pytest.mark.parametrize("seed", [None, 0, 1, 2**64 - 1])
def test_a_seed_survives_the_round_trip(seed):
    wire = sampling_to_proto(SamplingParams(temperature=1.0, seed=seed)).SerializeToString()
    msg = pb.SamplingParams.FromString(wire)
    assert msg.HasField("seed") is (seed is not None)
    assert sampling_from_proto(msg).seed == seed


@pytest.mark.parametrize("seed", [0, 9])
def test_an_older_peer_reads_the_seed_from_has_seed(seed):
    """An older reader takes ``seed`` only where ``has_seed`` is set; a seed of 0 must reach it too."""
    msg = pb.SamplingParams.FromString(sampling_to_proto(SamplingParams(seed=seed)).SerializeToString())
    assert msg.has_seed and msg.seed == seed
    assert not pb.SamplingParams.FromString(sampling_to_proto(SamplingParams()).SerializeToString()).has_seed


def test_an_older_writers_seed_of_zero_is_read():
    """An older writer's seed 0 is not on the wire (proto3 leaves default values off): only has_seed says it."""
    older = pb.SamplingParams(temperature=1.0, has_seed=True)
    assert not older.HasField("seed")
    assert sampling_from_proto(pb.SamplingParams.FromString(older.SerializeToString())).seed == 0
    assert sampling_from_proto(pb.SamplingParams(temperature=1.0)).seed is None
