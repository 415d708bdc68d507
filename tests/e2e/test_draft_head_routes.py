"""A draft head beyond the plain speculative route (tiny target, a tiny random EAGLE-3 head, real gRPC):

- structured output: the head drafts under the grammar (masked, forced tokens for free) and the output is
  token-identical to target-only decoding under the same grammar;
- the device (route=device, device fallback): a head cannot decode alone, so a head-only client is refused in one
  line before anything is sent; with a standalone draft beside it (``device_drafter``) the device decodes with
  that draft, and the head still drafts for the verifier.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from _heads import write_eagle3
from _reference import hf_greedy
from specdec.embedded import EmbeddedServer
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.errors import UnsupportedByDrafterError
from specdec_runtime.common.grammar import GrammarSpec
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.head import HeadDrafter
from specdec_runtime.edge_client.drafting.head_model import OnnxHead
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from test_structured_output import EOS, SCHEMAS, masked_greedy

pytestmark = pytest.mark.timeout(300)

DRAFT_VOCAB = sorted(set(range(0, 49152, 61)) | set(range(200)))


@pytest.fixture(scope="module")
def head_dir(tiny_pair, tmp_path_factory):
    from specdec.models.head_export import export_head

    root = tmp_path_factory.mktemp("head-routes")
    return export_head(tiny_pair.target_dir, write_eagle3(root / "ckpt", tiny_pair.target_dir, DRAFT_VOCAB),
                       root / "head")


@pytest.fixture(scope="module")
def address(tiny_pair):
    with EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir)), grace_s=1.0) as address:
        yield address


def test_structured_output_with_a_head_drafts_under_the_grammar_and_is_exact(tiny_pair, head_dir, address):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir).eval()
    head = OnnxHead(head_dir)
    schema = SCHEMAS[0]
    spec = GrammarSpec.json_schema(schema)
    with EdgeClient(GrpcBackend(address), HeadDrafter(head), head.tokenizer, num_speculative_tokens=4) as client:
        for prompt in ("Give me JSON.", "A user record:"):
            ids = encode_prompt(head.tokenizer, prompt)
            ref = masked_greedy(hf, head.tokenizer, ids, spec, 80)
            got = client.generate(ids, max_new_tokens=80, grammar=spec)
            assert got.token_ids in (ref, ref[:-1]) and ref[-1] == EOS, prompt
            jsonschema.validate(json.loads(got.text), schema)
            # the head drafted under the grammar: key names and punctuation forced, drafted for free
            assert got.stats.num_forced_tokens > 0 and got.stats.num_draft_tokens > got.stats.num_forced_tokens


def test_a_head_alone_cannot_decode_on_the_device_one_line(head_dir):
    head = OnnxHead(head_dir)
    backend = FailoverBackend("127.0.0.1:1", policy=RetryPolicy(connect_timeout_s=0.5, budget_s=1.0), connect=False)
    for kw, route in (({"fallback": "device"}, "speculative"), ({}, "device")):
        with EdgeClient(backend, HeadDrafter(head), head.tokenizer, **kw) as client:
            with pytest.raises(UnsupportedByDrafterError) as e:
                client.generate("Hello there", max_new_tokens=4, route=route)
        message = str(e.value)
        assert "draft head" in message and "device_drafter" in message and "\n" not in message


def test_a_standalone_draft_beside_the_head_decodes_on_the_device(tiny_pair, head_dir, address):
    head = OnnxHead(head_dir)
    draft = OnnxDraftModel(tiny_pair.draft_dir)  # the target exported: its greedy output is the target's
    ids = encode_prompt(head.tokenizer, "Tell me a story about a robot.")
    down = FailoverBackend("127.0.0.1:1", policy=RetryPolicy(connect_timeout_s=0.5, budget_s=1.0), connect=False)
    with EdgeClient(down, HeadDrafter(head), head.tokenizer, device_drafter=ModelDrafter(draft)) as client:
        chunks = list(client.stream_chunks(ids, max_new_tokens=12, ignore_eos=True, route="device"))
        device = client.last_result
    assert chunks and not any(c.verified for c in chunks) and device.num_unverified_tokens == 12
    assert device.token_ids == hf_greedy(tiny_pair.target_dir, ids, 12)
    with EdgeClient(GrpcBackend(address), HeadDrafter(head), head.tokenizer, fallback="device",
                    device_drafter=ModelDrafter(draft)) as client:  # the cloud answers: the head drafts, verified
        verified = client.generate(ids, max_new_tokens=12, ignore_eos=True)
    assert verified.token_ids == device.token_ids and verified.num_unverified_tokens == 0
    assert verified.stats.num_draft_tokens > 0
    with pytest.raises(TypeError, match="device_drafter must decode alone"):
        EdgeClient(down, HeadDrafter(head), head.tokenizer, device_drafter=HeadDrafter(head))


class _EveryTwoBlocks:
    """A RouteSwitcher that switches on a fixed schedule: to cloud decode after 2 speculative blocks, back after
    one 3-token cloud chunk, whatever the costs."""

    def to_cloud(self, client, run):
        return "every 2 blocks" if run.route.steps_in_mode >= 2 else None

    def to_speculative(self, client, run):
        return "after one cloud chunk" if run.route.steps_in_mode >= 1 else None

    def cloud_chunk_tokens(self, run):
        return 3


def test_cloud_decoded_tokens_and_later_turns_bring_their_features(tiny_pair, head_dir, address):
    """Cloud-decode chunks and ExtendSession answers carry the target's features: after switching between the
    routes and across a second turn, every committed position but the last has the verifier's feature (no gap
    where the head would draft from its own), and the output is target-only's."""
    head = OnnxHead(head_dir)
    ids = encode_prompt(head.tokenizer, "Tell me a story about a robot.")
    drafter = HeadDrafter(head)
    with EdgeClient(GrpcBackend(address), drafter, head.tokenizer, num_speculative_tokens=3,
                    route_switcher=_EveryTwoBlocks()) as client:
        got = client.generate(ids, max_new_tokens=30, ignore_eos=True)
        committed = ids + list(got.token_ids)
        assert got.token_ids == hf_greedy(tiny_pair.target_dir, ids, 30)
        assert got.route["tokens"]["cloud"] > 0 and got.route["tokens"]["speculative"] > 0
        assert drafter._known[: len(committed) - 1].all() and len(drafter._known) >= len(committed) - 1
        drafter.reset()  # a session that starts on the cloud: the open's features, then every chunk's
        cloud = client.generate(ids, max_new_tokens=8, ignore_eos=True, route="cloud")
        assert cloud.route["initial"] == "cloud" and cloud.route["tokens"]["cloud"] >= 3
        assert cloud.token_ids == got.token_ids[:8] and drafter._known[: len(ids) + 7].all()
        assert drafter._target_features_for(ids + list(cloud.token_ids)) == len(ids) + 7
    with EdgeClient(GrpcBackend(address), drafter, head.tokenizer, num_speculative_tokens=3) as client:
        with client.chat(max_new_tokens=12, ignore_eos=True) as chat:
            for message in ("Hi there.", "And then?"):
                "".join(c.text for c in chat.send(message))
                reply = client.last_result
                assert reply.num_sessions == 1 and reply.stats.num_draft_tokens > 0
            history = list(chat.history_ids)
    assert reply.token_ids == hf_greedy(tiny_pair.target_dir, history[: len(history) - 12], 12)
    assert drafter._target_features_for(history) == len(history) - 1 and drafter._known[: len(history) - 1].all()
