"""The SDK's multi-turn conversation (EdgeClient.chat): one verifier session across turns (ExtendSession), the
draft's KV cache kept, turn 2 token-identical to a fresh session over the whole history (in-process and over
gRPC), a lost session re-opened transparently, seeded sampled turns reproducible. Tiny models from conftest."""

from __future__ import annotations

import pytest

from _reference import hf_greedy
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.errors import SessionNotFoundError
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer, LocalBackend

N = 12  # tokens per reply
LONG = "Here is a long story about a cat who lived in a lighthouse and counted the ships every night. " * 4


class CountingDraft(OnnxDraftModel):
    """The real ONNX draft, counting the tokens fed to it (its KV cache's prefill work)."""

    fed = 0

    def forward(self, token_ids):
        self.fed += len(token_ids)
        return super().forward(token_ids)


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir)


@pytest.fixture(scope="module")
def local(runner):
    backend = LocalBackend(Verifier(runner, max_num_speculative_tokens=8))
    yield backend
    backend.close()


def _client(backend, draft_dir, gamma=4):
    model = CountingDraft(draft_dir)
    return EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=gamma)


def _two_turns(conv, **kw):
    text1 = "".join(c.text for c in conv.send(LONG, **kw))
    r1, h1 = conv.last_result, list(conv.history_ids)
    text2 = "".join(c.text for c in conv.send("And then?", **kw))
    return r1, h1, text1, conv.last_result, text2


@pytest.mark.parametrize("which", ["draft_dir", "other_draft_dir"])
def test_turn2_identical_to_a_fresh_session_in_process(tiny_pair, local, which):
    client = _client(local, getattr(tiny_pair, which))
    with client.chat(max_new_tokens=N, ignore_eos=True) as conv:
        r1, h1, text1, r2, text2 = _two_turns(conv)
        assert r2.session_id == r1.session_id == conv.session_id  # one session, extended
        assert r2.num_sessions == 1 and r2.num_reopened_sessions == 0
        turn2_prompt = r2.prompt_token_ids
        assert turn2_prompt[: len(h1)] == h1 and conv.history_ids == turn2_prompt + r2.token_ids
        assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
        assert conv.messages[1]["content"] == text1 and conv.messages[3]["content"] == text2 == r2.text
    fresh = _client(local, getattr(tiny_pair, which)).generate(turn2_prompt, max_new_tokens=N, ignore_eos=True)
    assert r2.token_ids == fresh.token_ids == hf_greedy(tiny_pair.target_dir, turn2_prompt, N)


def test_draft_feeds_only_the_new_turn(tiny_pair, local):
    """The draft keeps its KV cache across turns: turn 2 feeds it the appended ids and its own drafts, far less
    than the history (a re-prefill would feed all of it)."""
    client = _client(local, tiny_pair.other_draft_dir)
    with client.chat(max_new_tokens=N, ignore_eos=True) as conv:
        list(conv.send(LONG))
        before, history = client.drafter.model.fed, len(conv.history_ids)
        list(conv.send("And then?"))
        appended = len(conv.last_result.prompt_token_ids) - history
        fed = client.drafter.model.fed - before
    assert history > 100
    # appended ids + at most (γ + 1) draft forwards per committed token of the reply
    assert fed <= appended + 5 * N < history


def test_turn2_over_grpc_and_closed_conversation(tiny_pair, runner):
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    with EmbeddedServer(verifier=Verifier(runner), grace_s=1.0) as address:
        backend = GrpcBackend(address)
        try:
            client = _client(backend, tiny_pair.other_draft_dir)
            conv = client.chat(system="You are terse.", max_new_tokens=N, ignore_eos=True)
            r1, h1, _, r2, _ = _two_turns(conv)
            assert r2.session_id == r1.session_id and r2.num_reopened_sessions == 0
            assert conv.messages[0] == {"role": "system", "content": "You are terse."}
            fresh = client.generate(r2.prompt_token_ids, max_new_tokens=N, ignore_eos=True)
            assert r2.token_ids == fresh.token_ids
            sid = conv.session_id
            conv.close()
            with pytest.raises(SessionNotFoundError):  # the kept session is gone from the verifier
                backend.get_session(sid)
        finally:
            backend.close()


def test_lost_session_is_reopened_transparently(tiny_pair, local):
    """The verifier forgets the session between turns (as after its TTL or a restart with an empty store): turn
    2 opens a new session over the whole history, same output, counted in the result."""
    client = _client(local, tiny_pair.other_draft_dir)
    with client.chat(max_new_tokens=N, ignore_eos=True) as conv:
        list(conv.send(LONG))
        lost = conv.session_id
        assert local.verifier.close_session(lost)
        list(conv.send("And then?"))
        r2 = conv.last_result
    assert r2.num_reopened_sessions == 1 and r2.session_id != lost
    assert r2.token_ids == hf_greedy(tiny_pair.target_dir, r2.prompt_token_ids, N)


def test_seeded_sampled_turn2_is_reproducible(tiny_pair, local):
    """Two conversations with the same seed give the same turn 2; and so does a fresh session over the whole
    history with that seed (draws depend on the seed and the absolute position only)."""
    kw = dict(max_new_tokens=N, ignore_eos=True, temperature=0.9, top_k=50, seed=1234)
    outs = []
    for _ in range(2):
        with _client(local, tiny_pair.other_draft_dir).chat(**kw) as conv:
            r1, _, _, r2, _ = _two_turns(conv)
            outs.append((r1.token_ids, r2.token_ids, r2.prompt_token_ids))
    assert outs[0] == outs[1]
    fresh = _client(local, tiny_pair.other_draft_dir).generate(outs[0][2], **kw)
    assert fresh.token_ids == outs[0][1]
    other = _client(local, tiny_pair.other_draft_dir)
    with other.chat(**{**kw, "seed": 4321}) as conv:
        _, _, _, r2b, _ = _two_turns(conv)
    assert r2b.token_ids != outs[0][1]  # the seed matters (a fixed stream would pass the checks above)
