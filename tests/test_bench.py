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
    from common.errors import InvalidRequestError

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
