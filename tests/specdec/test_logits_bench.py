"""The logits-processing microbenchmark (``python -m specdec.logits_bench``, ``overall.logits_processing_ms`` of
a sampled ``specdec bench``): its report has every timing, and its fast paths agree with the reference."""

from __future__ import annotations

import json

from specdec import logits_bench


def test_report_shape_and_agreement():
    report = logits_bench.bench_logits_processing(vocab_size=4096, num_rows=3, repeats=2, synthetic=True,
                                                  settings=((0.7, 0, 0.9), (0.7, 50, 1.0)))
    assert report["logits"] == "synthetic" and report["num_rows"] == 3
    assert len(report["settings"]) == 2
    for entry in report["settings"]:
        assert entry["identical"] is True
        for path, names in (("edge", ("fast", "reference")), ("verifier", ("fast", "reference")),
                            ("edge_step", ("fast", "before"))):
            for name in names:
                timing = entry[path][name]
                assert 0 < timing["min"] <= timing["median"]
            assert entry[f"speedup_{path}"] > 0


def test_edge_q_is_the_drafters(monkeypatch):
    """The edge path times what the drafter calls: breaking draft_topk_distribution's ids shows in "identical"."""
    import numpy as np

    real = logits_bench.draft_topk_distribution

    def off_by_one(row, params, k, valid_vocab_size=None):
        ids, q = real(row, params, k, valid_vocab_size)
        return (ids + 1) % len(row), q

    monkeypatch.setattr(logits_bench, "draft_topk_distribution", off_by_one)
    report = logits_bench.bench_logits_processing(vocab_size=1024, num_rows=2, repeats=1, synthetic=True,
                                                  settings=((0.7, 0, 0.9),))
    assert report["settings"][0]["identical"] is False
    assert np.isfinite(report["settings"][0]["edge"]["fast"]["median"])


def test_main_prints_json(capsys):
    logits_bench.main(["--vocab-size", "2048", "--rows", "2", "--repeats", "1", "--synthetic"])
    out = json.loads(capsys.readouterr().out)
    assert out["vocab_size"] == 2048 and out["settings"]
