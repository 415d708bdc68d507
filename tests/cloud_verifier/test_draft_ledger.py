"""The acceptance ledger per draft version (cloud_verifier.drafts.ledger): Prometheus counters labelled
draft_version, and the record two replicas share through the session store (real Redis, and the in-process
store), with its baseline frozen after the first baseline_blocks verify steps. The catalog's own rules
(cloud_verifier.drafts.catalog) are checked here too, on folders made by publish_draft."""

from __future__ import annotations

import json

import pytest


def _sample(name: str, label: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(f"{name}_total", {"draft_version": label}) or 0.0


def test_two_replicas_share_one_record_and_freeze_the_baseline(memory_or_redis_store):
    import uuid

    from specdec_runtime.cloud_verifier.drafts.ledger import AcceptanceLedger

    store = memory_or_redis_store
    label = f"d{uuid.uuid4().hex[:8]}@v1"
    name, version = label.split("@")
    replicas = [AcceptanceLedger(store, baseline_blocks=4, flush_interval_s=3600.0)]
    # the in-process store is one process's: only a Redis store is shared by a second ledger
    shared = hasattr(store, "client")
    if shared:
        replicas.append(AcceptanceLedger(store, baseline_blocks=4, flush_interval_s=3600.0))
    for i in range(3):  # 3 steps of 4 draft tokens, 3 accepted each (acceptance 0.75)
        replicas[i % len(replicas)].tally(name, version).observe(4, 3)
    for r in replicas:
        r.flush()
    before = replicas[0].record(label)
    assert (before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens) == (3, 12, 9)
    assert before.baseline is None  # 3 < baseline_blocks
    for i in range(3):  # 3 more steps at acceptance 0.25: the baseline froze at the 4th step's flush
        replicas[-1].tally(name, version).observe(4, 1)
        replicas[-1].flush()
    after = replicas[0].record(label)
    assert (after.num_drafts, after.num_draft_tokens, after.num_accepted_tokens) == (6, 24, 12)
    assert after.baseline == (4, 16, 10) and after.baseline_acceptance_rate == pytest.approx(10 / 16)
    assert after.acceptance_rate == pytest.approx(0.5)
    assert _sample("specdec_draft_num_draft_tokens", label) == 24
    assert _sample("specdec_draft_num_accepted_tokens", label) == 12
    assert replicas[0].tally("", "").label is None  # a session that names no draft is not labelled
    if shared:
        store.client.delete(replicas[0].key(label))


def test_catalog_rules(tiny_pair, tmp_path):
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, publish_draft, set_current
    from specdec_runtime.common.draft_manifest import MANIFEST_FILE
    from specdec_runtime.common.errors import DraftNotFoundError

    publish_draft(tiny_pair.draft_dir, tmp_path, "d", "1")
    publish_draft(tiny_pair.draft_dir, tmp_path, "d", "2")
    publish_draft(tiny_pair.draft_dir, tmp_path, "only-acme", "1", tenants=("acme",))
    catalog = DraftCatalog(tmp_path, rescan_interval_s=0.0)
    assert catalog.resolve("globex", "d").version == "2"  # the last published is CURRENT
    set_current(tmp_path, "d", "1")
    assert catalog.resolve("globex", "d").version == "1"  # a rollback is CURRENT moved back
    assert catalog.resolve("acme").name == "d"  # the first name (sorted) when none is asked for
    assert [m.label for m in catalog.list("globex")] == ["d@2", "d@1"]
    assert {m.name for m in catalog.list("acme")} == {"d", "only-acme"}
    with pytest.raises(DraftNotFoundError):
        catalog.version("only-acme", "1", "globex")
    with pytest.raises(FileExistsError):
        publish_draft(tiny_pair.draft_dir, tmp_path, "d", "1")  # versions are immutable
    # a version whose file no longer has its manifest's size is never served
    manifest_path = tmp_path / "d" / "1" / MANIFEST_FILE
    raw = json.loads(manifest_path.read_text())
    raw["files"][0]["size"] += 1
    manifest_path.write_text(json.dumps(raw))
    catalog.rescan()
    assert [m.label for m in catalog.list("globex") if m.name == "d"] == ["d@2"]
    assert catalog.resolve("globex", "d").version == "2"  # CURRENT names a broken version: the newest good one


def test_publish_time_baseline_drives_the_watchdog(tiny_pair, tmp_path):
    """`draft publish --baseline-from BENCH_JSON` stores the bench's acceptance rate in the manifest; the watchdog
    judges a window against it before the version has any baseline of its own (a version without one: not
    judged)."""
    from typer.testing import CliRunner

    from specdec.cli import app
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, read_quarantined
    from specdec_runtime.cloud_verifier.drafts.ledger import AcceptanceLedger
    from specdec_runtime.cloud_verifier.drafts.watchdog import Watchdog

    root = tmp_path / "drafts"
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"overall": {"acceptance_rate": 0.9, "mean_accepted_length": 3.1}}))
    cli = CliRunner()
    res = cli.invoke(app, ["draft", "publish", str(tiny_pair.draft_dir), "--name", "b", "--version", "1",
                           "--drafts-dir", str(root), "--baseline-from", str(bench)])
    assert res.exit_code == 0 and "baseline acceptance 0.900" in res.output, res.output
    res = cli.invoke(app, ["draft", "publish", str(tiny_pair.draft_dir), "--name", "n", "--version", "1",
                           "--drafts-dir", str(root)])
    assert res.exit_code == 0, res.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"overall": {"tokens_per_s": 12}}))
    res = cli.invoke(app, ["draft", "publish", str(tiny_pair.draft_dir), "--name", "x", "--version", "1",
                           "--drafts-dir", str(root), "--baseline-from", str(bad)])
    assert res.exit_code != 0 and "not a bench report with an acceptance rate" in res.output
    catalog = DraftCatalog(root, rescan_interval_s=0.0)
    assert {m.label: m.baseline_acceptance_rate for m in catalog.list_all()} == {"b@1": 0.9, "n@1": None}
    ledger = AcceptanceLedger(baseline_blocks=1000, window_blocks=8)  # no baseline of their own for long
    for label in ("b@1", "n@1"):
        for _ in range(8):  # acceptance 0.5: 0.4 below the published 0.9
            ledger.tally(*label.split("@")).observe(4, 2)
    assert Watchdog(catalog, ledger, margin=0.2).check() == [("b@1", "quarantine:")]
    assert "1" in read_quarantined(root / "b") and not read_quarantined(root / "n")
