"""The acceptance watchdog on a real gRPC verifier (the tiny target): a good draft sets its baseline, then the
target is perturbed in place (its weights noised: a target upgrade the draft no longer fits); the draft's windowed
acceptance falls below its baseline and the version is quarantined within a bounded number of verify steps; a
metric and a log line say why; new generations run on the cloud route; an operator's clear takes it back. Every
output equals target-only decoding on the same (perturbed) target through the same verifier."""

from __future__ import annotations

import logging

import pytest

from conftest import PROMPT_IDS

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # ~6-10 s on 2 busy cores

WINDOW = 12
MAX_NEW = 16


@pytest.fixture(scope="module")
def watched(tiny_pair, tmp_path_factory):
    from specdec.embedded import EmbeddedServer
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, publish_draft
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    root = tmp_path_factory.mktemp("watched-drafts")
    publish_draft(tiny_pair.draft_dir, root, "w", "1")
    runner = TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192)
    verifier = Verifier(runner, max_batch_wait_ms=0.0)
    verifier.ledger.baseline_blocks, verifier.ledger.window_blocks = 8, WINDOW
    catalog = DraftCatalog(root, rescan_interval_s=0.0, watchdog_margin=0.3)
    with EmbeddedServer(verifier=verifier, grace_s=1.0, drafts=catalog) as address:
        yield address, root, catalog, runner


def _quarantined(label: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("specdec_draft_quarantined", {"draft_version": label}) or 0.0


def test_perturbed_target_quarantines_the_draft(watched, tmp_path, caplog):
    import torch

    from specdec import EdgeClient
    from specdec_runtime.cloud_verifier.drafts.catalog import set_quarantine
    from specdec.openai_server.spec_metrics import edge_cloud
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    address, root, catalog, runner = watched
    client = EdgeClient.connect(address, delivery=True, draft_cache_dir=tmp_path, draft_name="w",
                                draft_check_interval_s=0.0)
    reference = EdgeClient(GrpcBackend(address), None, client.tokenizer)  # target-only, same verifier

    def generate_and_check():
        ids = client.generate(PROMPT_IDS, max_new_tokens=MAX_NEW, ignore_eos=True).token_ids
        assert ids == reference.generate(PROMPT_IDS, max_new_tokens=MAX_NEW, ignore_eos=True).token_ids
        return client.last_result

    try:
        for _ in range(3):  # the good pair: acceptance ~1, the baseline is set after 8 verify steps
            assert generate_and_check().stats.acceptance_rate > 0.9
        assert "1" not in catalog.quarantined("w")
        with torch.no_grad():  # the target changes under the draft
            gen = torch.Generator().manual_seed(7)
            for p in runner.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * p.std() * 0.8)
        with caplog.at_level(logging.WARNING):
            for _ in range(8):  # bounded: a generation is >= 4 verify steps; the window is 12
                result = generate_and_check()
                if catalog.quarantined("w"):
                    break
        assert "1" in catalog.quarantined("w") and _quarantined("w@1") == 1
        assert any("draft w@1 quarantined: acceptance" in r.getMessage() for r in caplog.records)
        result = generate_and_check()  # the next generation: the cloud route, no draft token sent
        assert result.route["requested"] == "cloud" and result.stats.num_draft_tokens == 0
        ec = edge_cloud(result, None, client.draft_version)  # the OpenAI response's metrics.edge_cloud
        assert ec["fallback_reason"].startswith("draft w@1 quarantined by the verifier: acceptance ")
        set_quarantine(root, "w", "1", None)  # the operator clears it (specdec draft clear w 1)
        result = generate_and_check()
        assert result.route["requested"] == "speculative" and "fallback" not in result.route
    finally:
        client.close()
        reference.close()
