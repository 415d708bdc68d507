"""edge_client.generation.context: EdgeClient is a GenerationContext (every attribute the protocol names), and
the loop runs on any object that has them (the plain one of conftest.py), token for token as the client."""

from __future__ import annotations

from conftest import PROMPT_IDS, PlainContext
from specdec_runtime.common.types import SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.generation.context import GenerationContext
from specdec_runtime.edge_client.generation.loop import generate


def test_the_client_and_a_plain_context_are_generation_contexts(room_local, room_draft, room_reference):
    names = set(GenerationContext.__annotations__)
    client = EdgeClient(room_local, ModelDrafter(room_draft), room_draft.tokenizer, num_speculative_tokens=3)
    plain = PlainContext(room_local, client.drafter, room_draft.tokenizer, fingerprint=client.fingerprint)
    assert names and all(hasattr(client, n) for n in names) and all(hasattr(plain, n) for n in names)
    by_client = client.generate(PROMPT_IDS, max_new_tokens=24, ignore_eos=True).token_ids
    list(generate(plain, PROMPT_IDS, SamplingParams(), StoppingCriteria(24, ignore_eos=True)))
    assert by_client == plain.last_result.token_ids == room_reference
