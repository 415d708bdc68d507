"""`specdec bench --drafts`: prepared drafts by name side by side against one target-only baseline
(specdec/bench/drafts.py, specdec/models/named_drafts.py), on the tiny pair and a tiny random EAGLE-3 head; the
predicted speedup's formula; one-line errors for names that are not prepared."""

from __future__ import annotations

import json
import shutil

import pytest

from _heads import write_eagle3
from specdec.bench.drafts import predicted_speedup, run_drafts_bench
from specdec.models.named_drafts import DRAFT_NAMES, resolve_named_draft
from specdec_runtime.common.paths import DRAFT_DIR_NAME, ModelNotFoundError

PROMPTS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about autumn leaves."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
]


def _prompts(path):
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return path


@pytest.fixture(scope="module")
def head_dir(tiny_pair, tmp_path_factory):
    from specdec.models.head_export import export_head

    root = tmp_path_factory.mktemp("drafts-head")
    ckpt = write_eagle3(root / "ckpt", tiny_pair.target_dir, sorted(set(range(0, 49152, 61)) | set(range(200))))
    return export_head(tiny_pair.target_dir, ckpt, root / "head")


def test_predicted_speedup_is_leviathans_formula():
    assert predicted_speedup(0.5, 4, 0.0) == pytest.approx((1 - 0.5 ** 5) / 0.5)
    assert predicted_speedup(1.0, 4, 0.1) == pytest.approx(5 / 1.4)
    assert predicted_speedup(0.0, 4, 0.25) == pytest.approx(1 / 2.0)
    # a fractional γ (adaptive: the mean block) lies between its two integer neighbours
    lo, hi = predicted_speedup(0.8, 3, 0.1), predicted_speedup(0.8, 4, 0.1)
    assert min(lo, hi) < predicted_speedup(0.8, 3.5, 0.1) < max(lo, hi)
    assert predicted_speedup(0.8, 4, None) is None


def test_drafts_side_by_side_against_one_baseline(tiny_pair, head_dir, tmp_path):
    """The target's own ONNX export and a random head, each at γ = 3 and adaptive: token-identical to target-only;
    the per-position acceptance is what the counts say; the head is read as a head."""
    report = run_drafts_bench(_prompts(tmp_path / "q.jsonl"), [str(tiny_pair.draft_dir), str(head_dir)],
                              max_new_tokens=10, num_speculative_tokens=3, target=tiny_pair.target_dir)
    json.dumps(report)
    model, head = report["drafts"][str(tiny_pair.draft_dir)], report["drafts"][str(head_dir)]
    assert (model["kind"], head["kind"]) == ("model", "head")
    for d in (model, head):
        assert d["draft_step_ms"] > 0 and d["files_mb"] > 0
        assert d["token_identical"] and not d["mismatches"]
        for mode in ("fixed", "adaptive"):
            m = d[mode]
            assert 0 <= m["acceptance_rate"] <= 1 and m["num_tokens"] == 20
            assert all(a is None or 0 <= a <= 1 for a in m["acceptance_per_position"])
            assert m["draft_cost_ratio"] > 0 and m["speedup_vs_target_only"] > 0
            assert m["predicted_speedup"] == pytest.approx(
                predicted_speedup(m["acceptance_rate"], m["mean_draft_tokens_per_block"], d["draft_step_cost_ratio"]))
    assert len(model["fixed"]["acceptance_per_position"]) == 3
    # the target's own weights as the draft (fp32): nearly every draft token is accepted, at every position
    assert model["fixed"]["acceptance_rate"] > 0.9
    assert min(model["fixed"]["acceptance_per_position"]) > 0.8
    assert report["target_only"]["tokens_per_s"] > 0 and report["target_forward_ms"]["1_token"] > 0


def test_named_drafts_resolve_in_the_cache_or_say_what_to_prepare(tiny_pair, head_dir, tmp_path):
    shutil.copytree(tiny_pair.draft_dir, tmp_path / DRAFT_DIR_NAME)
    assert resolve_named_draft("int8", tmp_path) == (tmp_path / DRAFT_DIR_NAME).resolve()
    assert resolve_named_draft(str(head_dir), tmp_path) == head_dir.resolve()
    for name in ("distilled", "head"):
        with pytest.raises(ModelNotFoundError, match=f"run `{DRAFT_NAMES[name][1]}`"):
            resolve_named_draft(name, tmp_path)
    with pytest.raises(ModelNotFoundError, match="unknown draft 'nope'"):
        resolve_named_draft("nope", tmp_path)


def test_cli_drafts_errors_are_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from specdec.cli import app

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    prompts = _prompts(tmp_path / "q.jsonl")
    cases = [
        (["--drafts", "nope,int8"], "unknown draft 'nope'"),
        (["--drafts", "head"], "draft 'head' is not prepared"),
        (["--drafts", "int8", "--wan", "0"], "--drafts is a mode of its own"),
        (["--drafts", ","], "--drafts takes"),
        (["--wan", "0", "--draft", "distilled"], "run `specdec draft install`"),
    ]
    for args, needle in cases:
        result = CliRunner().invoke(app, ["bench", "--prompts", str(prompts), *args])
        assert result.exit_code == 2, result.output
        err = result.stderr.strip()
        assert err.startswith("error:") and needle in err and "\n" not in err, err


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["edge-serve", "--port", "0"]])
@pytest.mark.parametrize("flag", [["--fallback", "device"], ["--route", "device"]])
def test_cli_device_with_a_head_only_is_one_line_with_the_clis_remedy(head_dir, command, flag):
    """A head cannot decode alone: the remedy named is the CLI's (--device-draft beside it, or --draft an ONNX
    draft instead), not the SDK's."""
    from typer.testing import CliRunner

    from specdec.cli import app

    result = CliRunner().invoke(app, [command[0], "--draft", str(head_dir), *flag, *command[1:]], input="")
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith(f"error: {' '.join(flag)} needs a draft that decodes alone") and "\n" not in err, err
    assert f"{head_dir} is a draft head" in err, err  # said before any model loads, naming the directory
    assert "give --device-draft a draft that decodes alone (int8, distilled" in err and "EdgeClient" not in err, err


def test_a_head_refused_on_the_device_at_run_time_gets_the_clis_remedy(head_dir):
    """A head the CLI did not see as a --draft directory (a delivered one) is refused by the drafter contract;
    the CLI's line gives its own remedy."""
    from specdec.cli._shared import explain
    from specdec_runtime.common.errors import UnsupportedByDrafterError
    from specdec_runtime.common.types import SamplingParams
    from specdec_runtime.edge_client.drafting.contract import check_request
    from specdec_runtime.edge_client.drafting.head import HeadDrafter
    from specdec_runtime.edge_client.drafting.head_model import OnnxHead

    for route, fallback, flag in (("device", "none", "--route device"), ("speculative", "device",
                                                                          "--fallback device")):
        with pytest.raises(UnsupportedByDrafterError) as e:
            check_request(HeadDrafter(OnnxHead(head_dir)), SamplingParams(), route, fallback)
        line = explain(e.value)
        assert line.startswith(f"{flag} needs a draft that decodes alone;") and "is a draft head" in line, line
        assert "give --device-draft a draft that decodes alone (int8, distilled" in line, line
        assert "EdgeClient" not in line, line
