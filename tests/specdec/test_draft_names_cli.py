"""`--draft NAME` on every command that drafts (generate, chat, edge-serve; bench has its own tests): the names of
specdec/models/named_drafts.py (int8, distilled, head) or a directory, resolved in one place
(specdec.cli.checks.resolve_draft_option). A head given by name drafts with the head, fed the verifier's features,
and the output stays the target's; an unknown name, or a name whose draft is not prepared, is one line naming the
command that prepares it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from _heads import write_eagle3
from _reference import hf_greedy
from specdec.cli import app
from specdec.models.named_drafts import HEAD_DIR_NAME

pytestmark = pytest.mark.timeout(300)

PROMPT = "Name three colors."
MAX_NEW = 12


@pytest.fixture(scope="module")
def cache(tiny_pair, tmp_path_factory):
    """A model cache holding a (tiny, random) head for the tiny target where `specdec models prepare` installs the
    shipped one, so that the name `head` finds it."""
    from specdec.models.head_export import export_head

    root = tmp_path_factory.mktemp("named-head")
    ckpt = write_eagle3(root / "ckpt", tiny_pair.target_dir, sorted(set(range(0, 49152, 61)) | set(range(200))))
    export_head(tiny_pair.target_dir, ckpt, root / "cache" / HEAD_DIR_NAME)
    return root / "cache"


def _one_line_error(result, needle: str) -> str:
    assert result.exit_code == 2, (result.output, result.stderr)
    err = result.stderr.strip()
    assert err.startswith("error:") and needle in err and "\n" not in err, err
    return err


def test_generate_draft_head_by_name_is_the_targets_output(tiny_pair, cache, monkeypatch):
    from transformers import AutoTokenizer

    from specdec_runtime.edge_client.client import encode_prompt

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache))
    result = CliRunner().invoke(app, ["generate", PROMPT, "--json", "--max-new-tokens", str(MAX_NEW), "--ignore-eos",
                                      "--target", str(tiny_pair.target_dir), "--draft", "head"])
    assert result.exit_code == 0, (result.output, result.stderr)
    out = json.loads([line for line in result.stdout.splitlines() if line.strip()][-1])
    tok = AutoTokenizer.from_pretrained(tiny_pair.target_dir)
    assert out["token_ids"] == hf_greedy(tiny_pair.target_dir, encode_prompt(tok, PROMPT), MAX_NEW)
    assert out["num_draft_tokens"] > 0 and out["num_unverified_tokens"] == 0


def test_a_head_by_name_drafts_from_the_verifiers_features(tiny_pair, cache, monkeypatch):
    """The pipeline the CLI builds from `--draft head`: the drafter is a HeadDrafter, and after a generation every
    committed position but the last has the feature the (embedded, loopback gRPC) verifier sent."""
    from specdec.cli.checks import resolve_draft_option
    from specdec.cli.pipeline import build_pipeline
    from specdec_runtime.edge_client.client import encode_prompt
    from specdec_runtime.edge_client.drafting.head import HeadDrafter

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache))
    draft = resolve_draft_option("head")
    assert draft == (cache / HEAD_DIR_NAME).resolve()
    client, close = build_pipeline(tiny_pair.target_dir, draft, server=None, in_process=False, target_only=False,
                                   draft_top_k=1, num_speculative_tokens=4, device="cpu", dtype="float32")
    try:
        assert isinstance(client.drafter, HeadDrafter)
        got = client.generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
    finally:
        close()
    assert got.stats.num_draft_tokens > 0
    committed = encode_prompt(client.tokenizer, PROMPT) + list(got.token_ids)
    assert client.drafter._target_features_for(committed) == len(committed) - 1
    assert client.drafter._known[: len(committed) - 1].all()  # the target's own features, no gap


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["edge-serve", "--port", "0"]])
def test_unknown_or_unprepared_names_are_one_line_naming_the_command(command, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "empty-cache"))
    runner = CliRunner()
    err = _one_line_error(runner.invoke(app, [*command, "--draft", "nope"]), "unknown draft 'nope'")
    for name, install in (("int8", "specdec models prepare"), ("distilled", "specdec draft install"),
                          ("head", "specdec models prepare")):
        assert f"{name} (`{install}`)" in err, err
    _one_line_error(runner.invoke(app, [*command, "--draft", "head"]),
                    "draft 'head' is not prepared (no ")
    _one_line_error(runner.invoke(app, [*command, "--draft", "distilled"]), "run `specdec draft install`")
    _one_line_error(runner.invoke(app, [*command, "--draft", str(tmp_path)]), "no ONNX draft (model.onnx) and no "
                    "draft head (head.json)")


@pytest.mark.parametrize("command", [["chat"], ["edge-serve", "--port", "0"]])
def test_device_fallback_with_a_head_by_name_is_one_line(command, cache, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache))
    result = CliRunner().invoke(app, [*command, "--draft", "head", "--fallback", "device"])
    _one_line_error(result, "is a draft head")
