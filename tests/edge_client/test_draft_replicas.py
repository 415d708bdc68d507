"""Two verifiers (the tiny target, API keys for two tenants) on one Redis and one drafts folder: the acceptance
windows the watchdog reads are every replica's and per tenant, its decisions are taken in the background (no
client asks for a draft meanwhile), and a session resumed on the other replica keeps its draft version.

Tenant acme's traffic does not fit the version (its device drafts with the differently seeded tiny model under
the version's label: a drift the draft does not cover), globex's does. Every acme step goes to replica B; the
version is quarantined for acme only, and replica A answers acme with the quarantine and globex without."""

from __future__ import annotations

import time
import uuid

import pytest

from conftest import PROMPT_IDS

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # ~10-15 s on 2 busy cores

WINDOW = 12
MAX_NEW = 16


@pytest.fixture(scope="module")
def replicas(tiny_pair, tmp_path_factory, redis_url):
    """(addresses A and B, their verifiers, the drafts root, API keys by tenant)."""
    from contextlib import ExitStack

    from specdec.embedded import EmbeddedServer
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, publish_draft
    from specdec_runtime.cloud_verifier.security.auth import ApiKeyStore, append_api_key
    from specdec_runtime.cloud_verifier.security.transport import ServerSecurity
    from specdec_runtime.cloud_verifier.store import RedisSessionStore
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    root = tmp_path_factory.mktemp("replica-drafts")
    publish_draft(tiny_pair.draft_dir, root, "w", "1")
    key_file = root.parent / "replica-keys"
    keys = {t: append_api_key(key_file, t) for t in ("acme", "globex")}
    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    stores, verifiers, addresses = [], [], []
    with ExitStack() as stack:
        for name in ("A", "B"):
            store = RedisSessionStore(redis_url, prefix=prefix, ttl_s=60)
            verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), store,
                                verifier_id=f"replica-{name}", max_batch_wait_ms=0.0)
            verifier.ledger.baseline_blocks, verifier.ledger.window_blocks = 8, WINDOW
            verifier.ledger.flush_interval_s = 0.0
            catalog = DraftCatalog(root, rescan_interval_s=0.0, watchdog_margin=0.3)
            security = ServerSecurity(None, ApiKeyStore(key_file))
            addresses.append(stack.enter_context(EmbeddedServer(verifier=verifier, grace_s=1.0, security=security,
                                                                drafts=catalog)))
            stores.append(store)
            verifiers.append(verifier)
        yield addresses, verifiers, root, keys
    keys_left = list(stores[0].client.scan_iter(match=f"{prefix}*"))
    if keys_left:
        stores[0].client.delete(*keys_left)


def _client(address, key, cache, drafter_dir=None):
    """An EdgeClient on ``address`` with the delivered "w" (resolved once: no ResolveDraft after this);
    ``drafter_dir``: draft with that ONNX model instead, under the delivered version's label."""
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.delivery import DeliveredDraft, DraftCache, DraftSource
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec_runtime.edge_client.transport.credentials import ChannelSecurity
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    security = ChannelSecurity.of(api_key=key, use_env=False)
    delivered = DeliveredDraft(DraftSource(address, security), DraftCache(cache), name="w", check_interval_s=3600.0)
    parts = delivered.load()
    drafter = ModelDrafter(OnnxDraftModel(drafter_dir)) if drafter_dir is not None else parts.drafter
    client = EdgeClient(GrpcBackend(address, security=security), drafter, parts.tokenizer, num_speculative_tokens=4)
    client.delivered = delivered
    return client


def _resolve(address, key):
    from specdec_runtime.edge_client.delivery import DraftSource
    from specdec_runtime.edge_client.transport.credentials import ChannelSecurity

    source = DraftSource(address, ChannelSecurity.of(api_key=key, use_env=False))
    try:
        return source.resolve("w")
    finally:
        source.close()


def test_shared_per_tenant_windows_and_background_quarantine(replicas, tiny_pair, room_reference, tmp_path):
    from specdec_runtime.cloud_verifier.drafts.catalog import read_quarantined

    (a, b), (va, vb), root, keys = replicas
    globex = _client(a, keys["globex"], tmp_path / "g")
    acme = _client(b, keys["acme"], tmp_path / "a", drafter_dir=tiny_pair.other_draft_dir)
    try:
        for _ in range(3):  # globex's traffic fits: it sets the baseline (8 verify steps) on replica A
            assert globex.generate(PROMPT_IDS, max_new_tokens=MAX_NEW, ignore_eos=True).token_ids == \
                room_reference[:MAX_NEW]
        assert va.ledger.record("w@1").baseline_acceptance_rate > 0.9
        result = acme.generate(PROMPT_IDS, max_new_tokens=MAX_NEW, ignore_eos=True)  # replica B only
        assert result.token_ids == room_reference[:MAX_NEW]  # every block verified: nothing wrong in the output
        assert result.stats.acceptance_rate < 0.5 and result.stats.num_drafts >= WINDOW
        deadline = time.monotonic() + 30  # the background checks run every 0.2 s; no client resolves meanwhile
        while "1" not in read_quarantined(root / "w") and time.monotonic() < deadline:
            time.sleep(0.1)
        states = read_quarantined(root / "w")
        assert set(states.get("1", {})) == {"acme"}, states  # acme's only: globex's window is fine
        assert "acceptance" in states["1"]["acme"]
        # replica A never saw an acme step, yet reads acme's window (shared), and answers by tenant
        assert va.ledger.windows.tenants("w@1") >= {"acme", "globex"}
        assert _resolve(a, keys["acme"]).quarantine_reason == states["1"]["acme"]
        assert _resolve(a, keys["globex"]).quarantine_reason == ""
    finally:
        globex.close()
        acme.close()


def test_session_resumed_on_the_other_replica_keeps_its_draft_version(replicas, room_reference):
    from prometheus_client import REGISTRY

    from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, StoppingCriteria
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    (a, b), (va, vb), _, keys = replicas

    def steps() -> float:
        return REGISTRY.get_sample_value("specdec_draft_num_drafts_total", {"draft_version": "w@1"}) or 0.0

    on_a, on_b = GrpcBackend(a, api_key=keys["globex"]), GrpcBackend(b, api_key=keys["globex"])
    try:
        opened = on_a.open_session(OpenRequest(list(PROMPT_IDS), SamplingParams(temperature=0.0),
                                               StoppingCriteria(max_new_tokens=MAX_NEW), draft_name="w",
                                               draft_version="1"))
        sid, length = opened.session_id, opened.committed_length
        verdict = on_a.submit(sid, 1, length, DraftBlock(room_reference[:3])).result(timeout=60)
        n = len(verdict.committed_token_ids)
        assert verdict.committed_token_ids == room_reference[:n]
        before = steps()
        block = DraftBlock(room_reference[n:n + 3])  # the next block goes to replica B: resumed from Redis there
        verdict = on_b.submit(sid, 2, length + n, block).result(timeout=60)
        assert verdict.committed_token_ids == room_reference[n:n + len(verdict.committed_token_ids)]
        assert vb.sessions.held(sid).draft.label == "w@1" and vb.sessions.held(sid).draft.tenant == "globex"
        assert steps() - before == 1  # B counted the step under the session's version
        on_b.close_session(sid)
    finally:
        on_a.close()
        on_b.close()


def test_canary_split_is_fair_across_replicas(replicas, tiny_pair):
    """20 new clients of a 50 % canary, 7 asking replica A and 13 replica B: exactly 10 get it (one counter in
    Redis; each replica counting its own would give 3 + 6), and each keeps its answer on the other replica."""
    from specdec_runtime.cloud_verifier.drafts.catalog import end_canary, publish_draft, start_canary
    from specdec_runtime.edge_client.delivery import DraftSource
    from specdec_runtime.edge_client.transport.credentials import ChannelSecurity

    (a, b), _, root, keys = replicas
    publish_draft(tiny_pair.draft_dir, root, "w", "2", make_current=False)
    start_canary(root, "w", "2", 0.5)
    security = ChannelSecurity.of(api_key=keys["globex"], use_env=False)

    def resolve(address, i):
        source = DraftSource(address, security, client_id=f"fair-{i}")
        try:
            return source.resolve("w").version
        finally:
            source.close()

    try:
        got = {i: resolve(a if i < 7 else b, i) for i in range(20)}
        assert sorted(got.values()).count("2") == 10, got
        again = {i: resolve(b if i < 7 else a, i) for i in reversed(range(20))}  # sticky on the other replica
        assert again == got
    finally:
        end_canary(root, "w", promote=False)
