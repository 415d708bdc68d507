"""Draft delivery end to end on loopback: a real gRPC verifier (the tiny target, API keys on) hands out the tiny
ONNX draft; the SDK asks which draft to use, downloads it once, checks every file's SHA-256, loads it, and drafts
with it. Outputs are compared token for token with target-only greedy decoding (room_reference)."""

from __future__ import annotations

import grpc
import pytest

from conftest import PROMPT_IDS

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def delivery(tiny_pair, tmp_path_factory):
    """A verifier delivering "tiny" v1 (the target's own weights: open to every tenant) and "secret" v1 (acme
    only), with API keys for acme and globex; yields (address, keys, drafts root)."""
    from specdec.embedded import EmbeddedServer
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, publish_draft
    from specdec_runtime.cloud_verifier.security.auth import ApiKeyStore, append_api_key
    from specdec_runtime.cloud_verifier.security.transport import ServerSecurity
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    root = tmp_path_factory.mktemp("drafts")
    publish_draft(tiny_pair.draft_dir, root, "tiny", "v1")
    publish_draft(tiny_pair.draft_dir, root, "secret", "v1", tenants=("acme",))
    key_file = root.parent / "keys"
    keys = {t: append_api_key(key_file, t) for t in ("acme", "globex")}
    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=0.0)
    security = ServerSecurity(None, ApiKeyStore(key_file))
    catalog = DraftCatalog(root, default_name="tiny", rescan_interval_s=0.0)
    with EmbeddedServer(verifier=verifier, grace_s=1.0, security=security, drafts=catalog) as address:
        yield address, keys, root


def _counter(name: str, label: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(f"{name}_total", {"draft_version": label}) or 0.0


def _bytes_sent(label: str) -> float:
    return _counter("specdec_draft_bytes_sent", label)


def _source(address, key):
    from specdec_runtime.edge_client.delivery import DraftSource
    from specdec_runtime.edge_client.transport.credentials import ChannelSecurity

    return DraftSource(address, ChannelSecurity.of(api_key=key, use_env=False))


def test_first_connect_downloads_second_fetches_nothing(delivery, room_reference, tmp_path, caplog):
    import logging

    from specdec import EdgeClient

    address, keys, _ = delivery
    seen = []
    sent_before = _bytes_sent("tiny@v1")
    with EdgeClient.connect(address, delivery=True, draft_cache_dir=tmp_path, api_key=keys["globex"],
                            draft_progress=lambda path, have, size: seen.append((path, have, size))) as client:
        report = client.delivered.last_report
        assert report.manifest.label == "tiny@v1" and report.bytes_downloaded == report.manifest.size
        assert _bytes_sent("tiny@v1") - sent_before == report.manifest.size
        assert {p for p, _, _ in seen} == {f.path for f in report.manifest.files if f.size}
        assert all(have == size for p, have, size in seen if (p, have, size) == max(x for x in seen if x[0] == p))
        assert client.draft_version == ("tiny", "v1")
        steps_before = _counter("specdec_draft_num_drafts", "tiny@v1")
        with caplog.at_level(logging.INFO, logger="specdec.requests"):
            ids = client.generate(PROMPT_IDS, max_new_tokens=24, ignore_eos=True).token_ids
        assert ids == room_reference
        # the verifier's one line for the session (closed by the SDK before generate returns)
        lines = [r.getMessage() for r in caplog.records if r.name == "specdec.requests"
                 and client.last_result.session_id in r.getMessage()]
        assert len(lines) == 1, lines
        assert (f"tenant=globex route=speculative draft=tiny@v1 prompt_tokens={len(PROMPT_IDS)} output_tokens=24"
                in lines[0] and lines[0].endswith("finish=length"))
        stats = client.last_result.stats
        assert stats.num_accepted_tokens > 0  # the delivered draft did draft
        # the session said which version it drafts with: the verifier counted its steps under that label
        assert _counter("specdec_draft_num_drafts", "tiny@v1") - steps_before == stats.num_drafts
    sent_before = _bytes_sent("tiny@v1")
    with EdgeClient.connect(address, delivery=True, draft_cache_dir=tmp_path, api_key=keys["globex"]) as again:
        assert again.delivered.last_report.bytes_downloaded == 0
        assert _bytes_sent("tiny@v1") == sent_before


def test_flipped_byte_is_refused_and_fetched_again(delivery, tmp_path):
    from _proxy import ByteFlippingProxy
    from specdec_runtime.common.draft_manifest import sha256_file
    from specdec_runtime.edge_client.delivery.cache import DraftCache
    from specdec_runtime.edge_client.delivery.fetch import ensure_draft

    address, keys, _ = delivery
    proxy = ByteFlippingProxy(int(address.rsplit(":", 1)[1]))
    source = _source(f"127.0.0.1:{proxy.port}", keys["acme"])
    try:
        proxy.flip_next()
        report = ensure_draft(source, DraftCache(tmp_path))
    finally:
        source.close()
        proxy.close()
    assert proxy.num_flipped == 1
    assert report.files_refused == 1  # the corrupted file failed its sha256 ...
    for f in report.manifest.files:  # ... and the retry holds the right bytes
        assert sha256_file(report.folder / f.path) == f.sha256
    assert report.bytes_downloaded > report.manifest.size  # the refused file came twice


def test_truncated_part_resumes_and_truncated_cache_is_refetched(delivery, tmp_path):
    from specdec_runtime.edge_client.delivery.cache import PART_SUFFIX, DraftCache
    from specdec_runtime.edge_client.delivery.fetch import ensure_draft

    address, keys, _ = delivery
    source = _source(address, keys["acme"])
    cache = DraftCache(tmp_path)
    try:
        manifest = source.resolve()
        big = max(manifest.files, key=lambda f: f.size)
        first = ensure_draft(source, cache, manifest=manifest)
        # a download broken in the middle: the .part holds the first half, the rest is fetched from there
        data = (first.folder / big.path).read_bytes()
        incoming = tmp_path / "resume"
        resumed_cache = DraftCache(incoming)
        part = resumed_cache.incoming(manifest) / (big.path + PART_SUFFIX)
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(data[: big.size // 2])
        resumed = ensure_draft(source, resumed_cache, manifest=manifest)
        assert resumed.bytes_downloaded == manifest.size - big.size // 2
        # a cached file truncated on disk: the version is incomplete again, only that file is fetched
        with open(first.folder / big.path, "r+b") as f:
            f.truncate(big.size - 7)
        again = ensure_draft(source, cache, manifest=manifest)
        assert again.bytes_downloaded == big.size
        assert (again.folder / big.path).read_bytes() == data
    finally:
        source.close()


def test_tenant_rules_and_keys(delivery):
    from specdec_runtime.common.errors import DraftNotFoundError, UnauthenticatedError
    from specdec_runtime.common.v1 import verifier_pb2 as pb

    address, keys, _ = delivery
    acme, globex, bad = _source(address, keys["acme"]), _source(address, keys["globex"]), _source(address, "sk-x")
    try:
        assert acme.resolve("secret").label == "secret@v1"
        with pytest.raises(DraftNotFoundError):
            globex.resolve("secret")  # another tenant's draft does not exist for it
        with pytest.raises(UnauthenticatedError):
            bad.resolve()
        stub, meta = globex._stub, globex._metadata
        listed = stub.ListDrafts(pb.DraftListRequest(), metadata=meta)
        assert [d.name for d in listed.drafts] == ["tiny"]
        with pytest.raises(grpc.RpcError) as err:
            list(stub.FetchDraft(pb.FetchDraftRequest(name="secret", version="v1", path="model.onnx"), metadata=meta))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        manifest = globex.resolve()
        size = manifest.files[0].size
        with pytest.raises(grpc.RpcError) as err:
            list(stub.FetchDraft(pb.FetchDraftRequest(name="tiny", version="v1", path=manifest.files[0].path,
                                                      offset=size + 1), metadata=meta))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        with pytest.raises(grpc.RpcError) as err:
            list(stub.FetchDraft(pb.FetchDraftRequest(name="tiny", version="v1", path="../keys"), metadata=meta))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        for s in (acme, globex, bad):
            s.close()


def test_new_version_is_taken_at_the_next_generation(delivery, tiny_pair, room_reference, tmp_path):
    from specdec import EdgeClient
    from specdec_runtime.cloud_verifier.drafts.catalog import publish_draft, set_current

    address, keys, root = delivery
    client = None
    publish_draft(tiny_pair.draft_dir, root, "swap", "a")
    try:
        client = EdgeClient.connect(address, delivery=True, draft_cache_dir=tmp_path, api_key=keys["acme"],
                                    draft_name="swap", draft_check_interval_s=0.0)
        first_drafter = client.drafter
        chunks = client.stream_chunks(PROMPT_IDS, max_new_tokens=24, ignore_eos=True)
        next(chunks)
        publish_draft(tiny_pair.other_draft_dir, root, "swap", "b")  # published mid-generation
        for _ in chunks:
            assert client.drafter is first_drafter  # never swapped in the middle of a generation
        assert client.last_result.token_ids == room_reference
        assert client.draft_version == ("swap", "a")
        result = client.generate(PROMPT_IDS, max_new_tokens=24, ignore_eos=True)
        assert client.draft_version == ("swap", "b") and client.drafter is not first_drafter
        assert result.token_ids == room_reference  # another draft, the same target-only output
        set_current(root, "swap", "a")  # a rollback is a version change too: cached, nothing fetched
        client.generate(PROMPT_IDS, max_new_tokens=4, ignore_eos=True)
        assert client.draft_version == ("swap", "a") and client.delivered.last_report.bytes_downloaded == 0
    finally:
        if client is not None:
            client.close()


def test_cloud_route_needs_only_the_tokenizer(delivery, room_reference, tmp_path):
    from specdec import EdgeClient

    address, keys, _ = delivery
    with EdgeClient.connect(address, delivery=True, draft_cache_dir=tmp_path, api_key=keys["acme"],
                            route="cloud") as client:
        report = client.delivered.last_report
        assert client.drafter is None
        assert 0 < report.bytes_downloaded < report.manifest.size
        assert not any(p.name == "model.onnx" for p in report.folder.rglob("*"))
        assert client.generate(PROMPT_IDS, max_new_tokens=24, ignore_eos=True).token_ids == room_reference
