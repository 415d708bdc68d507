"""specdec.bench: Spec-Bench-style report structure, counters and greedy agreement, on the tiny model pair."""

from __future__ import annotations

import io
import json

import pytest

from specdec import bench

PROMPTS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about autumn leaves.", "Now in French."]},
    {"question_id": 2, "category": "writing", "turns": ["Describe a cat in two sentences."]},
    {"question_id": 3, "category": "math", "turns": ["What is 12 times 7?"]},
]

M_KEYS = {
    "acceptance_rate",
    "mean_accepted_length",
    "tokens_per_s",
    "speedup_vs_target_only",
    "target_ms_per_token",
    "num_prompts",
    "num_tokens",
}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def bench_report(tiny_pair, tmp_path_factory):
    prompts = _write_jsonl(tmp_path_factory.mktemp("bench") / "q.jsonl", PROMPTS)
    return bench.run_bench(
        prompts,
        limit=None,
        max_new_tokens=8,
        num_speculative_tokens=3,
        target=tiny_pair.target_dir,
        draft=tiny_pair.draft_dir,
        hf_assisted=True,
        progress=False,
    )


def _check_m(m: dict, hf: bool) -> None:
    assert M_KEYS <= set(m)
    assert 0.0 <= m["acceptance_rate"] <= 1.0
    assert m["mean_accepted_length"] >= 1.0
    assert set(m["tokens_per_s"]) == {"target_only", "specdec", "hf_assisted"}
    assert set(m["speedup_vs_target_only"]) == {"specdec", "hf_assisted"}
    assert set(m["target_ms_per_token"]) == {"target_only", "specdec"}
    for v in ("target_only", "specdec") + (("hf_assisted",) if hf else ()):
        assert m["tokens_per_s"][v] > 0
    assert m["speedup_vs_target_only"]["specdec"] > 0
    assert (m["speedup_vs_target_only"]["hf_assisted"] is not None) == hf
    assert m["target_ms_per_token"]["target_only"] > 0 and m["target_ms_per_token"]["specdec"] > 0
    assert 0 < m["num_tokens"] <= 8 * m["num_prompts"]


def test_report_structure_and_counters(bench_report):
    r = bench_report
    assert {"overall", "categories", "config", "notes"} <= set(r)
    hf = r["config"]["hf_assisted"]
    if not hf:  # the tiny draft records no HF source: the report must say why HF assisted is missing
        assert any("hf_assisted" in n for n in r["notes"])
    assert list(r["categories"]) == ["writing", "math"]
    assert r["categories"]["writing"]["num_prompts"] == 2 and r["categories"]["math"]["num_prompts"] == 1
    assert r["overall"]["num_prompts"] == 3
    assert r["overall"]["num_tokens"] == sum(m["num_tokens"] for m in r["categories"].values())
    _check_m(r["overall"], hf)
    for m in r["categories"].values():
        _check_m(m, hf)
    o = r["overall"]
    assert o["draft_ms_per_token"] > 0 and o["draft_cost_ratio"] > 0
    assert r["config"]["max_new_tokens"] == 8 and r["config"]["num_speculative_tokens"] == 3
    json.dumps(r)  # the report is plain JSON


def test_greedy_outputs_agree(bench_report):
    agreement = bench_report["greedy_agreement"]
    expected = {"specdec_vs_target_only"}
    if bench_report["config"]["hf_assisted"]:
        expected.add("hf_assisted_vs_target_only")
    assert set(agreement) == expected
    for key, a in agreement.items():
        assert a["of"] == 3
        assert a["identical"] == 3, f"{key}: {a['mismatches']}"


def test_print_report(bench_report):
    from rich.console import Console

    buf = io.StringIO()
    bench.print_report(bench_report, console=Console(file=buf, width=200))
    text = buf.getvalue()
    assert "overall" in text and "writing" in text and "math" in text


def test_load_prompts_round_robin(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}"]} for i, c in enumerate("aaabbc")]
    path = _write_jsonl(tmp_path / "q.jsonl", rows)
    assert [p.question_id for p in bench.load_prompts(path)] == [0, 1, 2, 3, 4, 5]
    assert [p.question_id for p in bench.load_prompts(path, 3)] == [0, 3, 5]  # one per category first
    assert [p.question_id for p in bench.load_prompts(path, 5)] == [0, 3, 5, 1, 4]
    assert bench.load_prompts(path, 1)[0].prompt == "q0"


def test_load_prompts_errors(tmp_path):
    from specdec_runtime.common.errors import InvalidRequestError

    with pytest.raises(FileNotFoundError):
        bench.load_prompts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "x", "turns": []}\n')
    with pytest.raises(InvalidRequestError, match="bad.jsonl:1"):
        bench.load_prompts(bad)
    with pytest.raises(InvalidRequestError):
        bench.load_prompts(_write_jsonl(tmp_path / "ok.jsonl", PROMPTS), 0)


def test_clients_bench(tiny_pair, tmp_path):
    prompts = _write_jsonl(tmp_path / "q.jsonl", PROMPTS)
    r = bench.run_clients_bench(
        prompts,
        [1, 2],
        limit=2,
        max_new_tokens=6,
        num_speculative_tokens=3,
        target=tiny_pair.target_dir,
        draft=tiny_pair.draft_dir,
        progress=False,
    )
    assert set(r["clients"]) == {"1", "2"}
    for n, m in r["clients"].items():
        assert m["tokens_per_s"] > 0 and m["per_session_tokens_per_s"] > 0 and m["speedup_vs_serial"] > 0
        assert 1.0 <= m["mean_batch_size"] <= int(n)
        assert m["serial"]["mean_batch_size"] == 1.0
        assert m["greedy_identical_to_serial"]
        assert m["num_sessions"] == 2


def test_greedy_agreement_with_rejections(tiny_pair, tmp_path):
    """A draft that disagrees with the target (different seed): rejections happen, outputs still agree."""
    prompts = _write_jsonl(tmp_path / "q.jsonl", PROMPTS)
    r = bench.run_bench(
        prompts,
        limit=2,
        max_new_tokens=8,
        num_speculative_tokens=3,
        target=tiny_pair.target_dir,
        draft=tiny_pair.other_draft_dir,
        hf_assisted=True,
        progress=False,
    )
    assert r["overall"]["num_prompts"] == 2 and set(r["categories"]) == {"writing", "math"}  # round-robin
    assert r["overall"]["acceptance_rate"] < 1.0
    for key, a in r["greedy_agreement"].items():
        assert a["identical"] == a["of"] == 2, f"{key}: {a['mismatches']}"


# ---------------------------------------------------------------------------------------------- γ sweep

SWEEP_M_KEYS = {
    "acceptance_rate", "mean_accepted_length", "mean_block_tokens", "draft_ms_per_token", "draft_cost_ratio",
    "tokens_per_s", "speedup_vs_target_only", "target_ms_per_token", "num_prompts", "num_tokens", "num_steps",
}


def test_parse_sweep_and_delays():
    from specdec_runtime.common.errors import InvalidRequestError

    assert bench.parse_gamma_sweep("1-8") == list(range(1, 9))
    assert bench.parse_gamma_sweep("4,1-2, 8") == [1, 2, 4, 8]
    assert bench.parse_delays_ms("0,20,20") == [0.0, 20.0]
    for bad in ("0-2", "x", "3-1", ""):
        with pytest.raises(InvalidRequestError):
            bench.parse_gamma_sweep(bad)
    for bad in ("-5", "a", "", "inf"):
        with pytest.raises(InvalidRequestError):
            bench.parse_delays_ms(bad)


def test_gamma_sweep(tiny_pair, tmp_path):
    prompts = _write_jsonl(tmp_path / "q.jsonl", PROMPTS)
    plot = tmp_path / "out" / "sweep.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plot = None
    r = bench.run_gamma_sweep(
        prompts, [1, 2], limit=2, max_new_tokens=8, target=tiny_pair.target_dir, draft=tiny_pair.other_draft_dir,
        min_confidence=0.3, plot=plot,
    )
    assert list(r["gamma_sweep"]) == ["1", "2", "adaptive", "adaptive_no_truncation"]
    assert r["config"]["gammas"] == [1, 2] and r["config"]["adaptive_max_num_speculative_tokens"] == 2
    for name, mm in r["gamma_sweep"].items():
        assert set(mm) == {"overall", "categories"} and set(mm["categories"]) == {"writing", "math"}
        for m in [mm["overall"], *mm["categories"].values()]:
            assert SWEEP_M_KEYS <= set(m), name
            assert 0.0 <= m["acceptance_rate"] <= 1.0 and m["mean_accepted_length"] >= 1.0
            assert m["tokens_per_s"] > 0 and m["speedup_vs_target_only"] > 0 and m["draft_cost_ratio"] > 0
            assert 0 < m["mean_block_tokens"] <= 2
        if name.isdigit():  # fixed γ: every block is γ long (a block is cut only by the room left at the end)
            assert mm["overall"]["num_steps"] > 0
    o = r["gamma_sweep"]["1"]["overall"]
    assert o["num_prompts"] == 2 and o["num_tokens"] == r["target_only"]["overall"]["num_tokens"]
    assert r["target_only"]["overall"]["target_forward_ms_1_token"] > 0
    # the other draft disagrees with the target: rejections, yet every variant's greedy ids are the target's
    assert r["gamma_sweep"]["2"]["overall"]["acceptance_rate"] < 1.0
    assert set(r["greedy_agreement"]) == {"1", "2", "adaptive", "adaptive_no_truncation"}
    for v, a in r["greedy_agreement"].items():
        assert a["identical"] == a["of"] == 2, f"{v}: {a['mismatches']}"
    assert r["config"]["greedy_identical_all"]
    if plot is not None:
        assert plot.is_file() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert r["config"]["plot"] == str(plot)
    json.dumps(r)
    from rich.console import Console

    buf = io.StringIO()
    bench.print_report(r, console=Console(file=buf, width=200))
    assert "adaptive_no_truncation" in buf.getvalue() and "γ=2" in buf.getvalue()


def test_gamma_sweep_plot_needs_matplotlib(monkeypatch, tmp_path):
    """--plot fails before any model loads when matplotlib is missing, with a clear message."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    with pytest.raises(ImportError, match="pip install matplotlib"):
        bench.run_gamma_sweep(tmp_path / "missing.jsonl", [1], plot=tmp_path / "x.png")


# ---------------------------------------------------------------------------------------------- edge–cloud


@pytest.mark.slow  # 10-39 s measured
def test_edge_cloud_bench(tiny_pair, tmp_path):
    import os

    prompts = _write_jsonl(tmp_path / "q.jsonl", PROMPTS)
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    r = bench.run_edge_cloud_bench(
        prompts, [0, 5], limit=2, max_new_tokens=8, num_speculative_tokens=3, target=tiny_pair.target_dir,
        draft=tiny_pair.draft_dir, startup_timeout_s=120,
        min_confidence=0.0,  # the tiny random draft is rarely 30 % sure: truncation would cut every block to 1
    )
    if before is not None:
        assert os.sched_getaffinity(0) == before  # the bench process's affinity is restored
    assert set(r["edge_cloud"]) == {"0", "5"}
    for d, entry in r["edge_cloud"].items():
        assert set(entry) == {"cloud_only", "specdec", "specdec_proactive"}
        for v, m in entry.items():
            assert m["tokens_per_s"] > 0 and m["ratio_vs_cloud_only"] > 0, (d, v)
            assert m["num_prompts"] == 2 and 0 < m["num_tokens"] <= 16
            assert set(m["categories"]) == {"writing", "math"}
            assert m["target_ms_per_token"] > 0
        assert entry["cloud_only"]["ratio_vs_cloud_only"] == pytest.approx(1.0)
        assert entry["cloud_only"]["mean_accepted_length"] == 1.0 and entry["cloud_only"]["proactive_hits"] == 0
        assert entry["specdec"]["proactive_hits"] == 0
        assert entry["specdec"]["acceptance_rate"] > 0.9  # the draft is the target itself (fp32 ONNX)
        assert entry["cloud_only"]["streaming_model_tokens_per_s"] > 0
    assert r["edge_cloud"]["5"]["specdec_proactive"]["proactive_hits"] > 0  # blocks in flight for ≥ 10 ms
    assert r["config"]["greedy_identical_all"]
    for k, a in r["greedy_agreement"].items():
        assert a["identical"] == a["of"] == 2, f"{k}: {a['mismatches']}"
    assert r["config"]["verifier_exit_status"] is not None  # the server process is gone
    pin = r["config"]["pinning"]
    if pin["edge_core"] is not None:
        assert pin["edge_affinity_seen"] == [pin["edge_core"]]
        assert pin["verifier_affinity_seen"] == [pin["verifier_core"]]
    else:
        assert any("pin" in n for n in r["notes"])
    json.dumps(r)
    from rich.console import Console

    buf = io.StringIO()
    bench.print_report(r, console=Console(file=buf, width=220))
    assert "specdec_proactive" in buf.getvalue()


def test_edge_cloud_verifier_failure_is_reported_and_cleaned_up(tiny_pair, tmp_path):
    """A verifier that cannot start (no model at --target) fails fast with its log; no process is left."""
    prompts = _write_jsonl(tmp_path / "q.jsonl", PROMPTS)
    proc = bench.VerifierProcess(tmp_path / "no-such-model", None, startup_timeout_s=60)
    with pytest.raises(bench.VerifierProcessError, match="exited"):
        proc.start()
    assert proc.proc is None
    proc.remove_log()
    del prompts


def test_cli_bench_mode_errors(tmp_path):
    """The new bench options fail with one-line errors before loading anything."""
    from typer.testing import CliRunner

    from specdec.cli import app

    prompts = _write_jsonl(tmp_path / "q.jsonl", PROMPTS)
    cases = [
        (["--clients", "1", "--edge-cloud"], "separate modes"),
        (["--gamma-sweep", "1-2", "--edge-cloud"], "separate modes"),
        (["--plot", str(tmp_path / "p.png")], "--plot goes with --gamma-sweep"),
        (["--gamma-sweep", "0-2"], "--gamma-sweep"),
        (["--edge-cloud", "--delays-ms", "x"], "--delays-ms"),
    ]
    for args, needle in cases:
        result = CliRunner().invoke(app, ["bench", "--prompts", str(prompts), *args])
        assert result.exit_code == 2, result.output
        err = result.stderr.strip()
        assert err.startswith("error:") and needle in err and "\n" not in err, err
