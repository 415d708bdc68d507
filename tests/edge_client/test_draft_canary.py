"""Canary draft versions on a real gRPC verifier (the tiny target): a 50 % canary goes to exactly half of 20 new
clients (sticky per client id); a bad version (the differently seeded tiny draft: low acceptance) is rolled back
automatically once it and the current version have min_blocks verify steps, and its clients take the current
version at their next generation; a good canary is promoted. Every output is token-identical to target-only."""

from __future__ import annotations

import pytest

from conftest import PROMPT_IDS

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # ~6-8 s on 2 busy cores

MIN_BLOCKS = 8
MAX_NEW = 16


@pytest.fixture(scope="module")
def canary_server(tiny_pair, tmp_path_factory):
    from specdec.embedded import EmbeddedServer
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, publish_draft
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    root = tmp_path_factory.mktemp("canary-drafts")
    publish_draft(tiny_pair.draft_dir, root, "cn", "good")
    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=0.0)
    catalog = DraftCatalog(root, rescan_interval_s=0.0, canary_min_blocks=MIN_BLOCKS)
    with EmbeddedServer(verifier=verifier, grace_s=1.0, drafts=catalog) as address:
        yield address, root, catalog


def _client(address, cache, client_id):
    """An EdgeClient whose delivered draft is resolved under ``client_id`` (a device's stable id)."""
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.delivery import DeliveredDraft, DraftCache, DraftSource
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    delivered = DeliveredDraft(DraftSource(address, client_id=client_id), DraftCache(cache), name="cn",
                               check_interval_s=0.0)
    parts = delivered.load()
    client = EdgeClient(GrpcBackend(address), parts.drafter, parts.tokenizer, num_speculative_tokens=4)
    client.delivered = delivered
    return client


def _decisions(label: str, decision: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("specdec_draft_canary_decisions_total",
                                     {"draft_version": label, "decision": decision}) or 0.0


def test_bad_canary_is_rolled_back_good_one_promoted(canary_server, tiny_pair, room_reference, tmp_path):
    from specdec_runtime.cloud_verifier.drafts.catalog import publish_draft, start_canary
    from specdec_runtime.edge_client.delivery import DraftSource

    address, root, catalog = canary_server
    publish_draft(tiny_pair.other_draft_dir, root, "cn", "bad", make_current=False)
    start_canary(root, "cn", "bad", 0.5)
    # 20 new clients: half get the canary (the n-th new client by the canary's counter, not a hash of its id:
    # exactly 10); the same client gets the same answer again (sticky)
    got = {}
    for i in range(20):
        source = DraftSource(address, client_id=f"device-{i}")
        got[i] = source.resolve("cn").version
        assert source.resolve("cn").version == got[i]
        source.close()
    on_canary = [i for i, v in got.items() if v == "bad"]
    assert len(on_canary) == 10, got
    on_current = next(i for i, v in got.items() if v == "good")
    canary_client = _client(address, tmp_path, f"device-{on_canary[0]}")
    current_client = _client(address, tmp_path, f"device-{on_current}")
    try:
        assert canary_client.draft_version == ("cn", "bad") and current_client.draft_version == ("cn", "good")
        for _ in range(8):  # bounded: each generation is >= 4 verify steps of 4 draft tokens
            for client in (canary_client, current_client):
                ids = client.generate(PROMPT_IDS, max_new_tokens=MAX_NEW, ignore_eos=True).token_ids
                assert ids == room_reference[:MAX_NEW]
            if "cn" not in catalog.canaries():
                break
        assert "cn" not in catalog.canaries() and _decisions("cn@bad", "rollback") == 1
        assert catalog.current("cn") == "good"
        canary_client.generate(PROMPT_IDS, max_new_tokens=4, ignore_eos=True)  # its next generation
        assert canary_client.draft_version == ("cn", "good")
        # a good canary (the target's own weights again) is promoted: CURRENT moves to it
        publish_draft(tiny_pair.draft_dir, root, "cn", "good2", make_current=False)
        start_canary(root, "cn", "good2", 1.0)
        for _ in range(8):
            for client in (canary_client, current_client):
                ids = client.generate(PROMPT_IDS, max_new_tokens=MAX_NEW, ignore_eos=True).token_ids
                assert ids == room_reference[:MAX_NEW]
            if "cn" not in catalog.canaries():
                break
        assert catalog.current("cn") == "good2" and _decisions("cn@good2", "promote") == 1
    finally:
        canary_client.close()
        current_client.close()
