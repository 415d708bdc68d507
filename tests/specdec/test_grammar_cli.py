"""`specdec generate --json-schema/--regex/--grammar`: refused in one line before any model loads (two flags, a
file that cannot be read, a schema that is not JSON); the options become the SDK's grammar."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec_runtime.common.grammar import GrammarSpec
from specdec.cli.grammar_flags import grammar_options


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "hello", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (("--regex", "a+", "--json-schema", "/nonexistent.json"), "at most one"),
    (("--json-schema", "/nonexistent.json"), "cannot read"),
    (("--grammar", "/nonexistent.lark"), "cannot read"),
])
def test_refused_in_one_line_before_models_load(args, message):
    r = _cli(*args)
    assert r.returncode != 0 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_schema_that_is_not_json_is_one_line(tmp_path):
    bad = tmp_path / "s.json"
    bad.write_text("{not json")
    r = _cli("--json-schema", str(bad))
    assert r.returncode != 0 and "not valid JSON" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_options_are_the_grammar_spec(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    lark = tmp_path / "g.lark"
    lark.write_text('start: "yes" | "no"\n')
    assert grammar_options(None, None, None) == {}
    assert GrammarSpec.from_json(grammar_options(schema, None, None)["grammar"]).kind == "json_schema"
    assert GrammarSpec.from_json(grammar_options(None, r"\d+", None)["grammar"]) == GrammarSpec("regex", r"\d+")
    assert GrammarSpec.from_json(grammar_options(None, None, lark)["grammar"]).value == 'start: "yes" | "no"\n'


def test_chat_refuses_two_grammar_flags_in_one_line():
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--regex", "a+", "--grammar", "/x.lark"],
                       input="hi\n", capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "at most one" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow  # > 10 s here (measured): the full suite runs it, the quick tier does not
def test_chat_json_schema_constrains_every_reply(tiny_pair, tmp_path):
    """Two turns of `specdec chat --json-schema` (tiny pair, embedded verifier): each reply is one JSON document
    that validates (the grammar restarts at each turn's prompt)."""
    import jsonschema

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema))
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--target", str(tiny_pair.target_dir),
                        "--draft", str(tiny_pair.draft_dir), "--max-new-tokens", "60", "--json-schema", str(path)],
                       input="Pick a color.\nAnother one?\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    decoder, text, replies = json.JSONDecoder(), r.stdout.strip(), []
    while text:
        value, end = decoder.raw_decode(text)
        replies.append(value)
        text = text[end:].lstrip()
    assert len(replies) == 2, r.stdout
    for reply in replies:
        jsonschema.validate(reply, schema)


@pytest.mark.parametrize("args, message", [
    (("--json-schema", "/nonexistent.json"), "--json-schema /nonexistent.json"),
    (("--json-schema", "/nonexistent.json", "--clients", "1"), "separate modes"),
])
def test_bench_json_schema_refused_in_one_line(args, message):
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow  # > 10 s here (measured): the full suite runs it, the quick tier does not
def test_bench_json_schema_reports_both_speedups_as_json(tiny_pair, tmp_path):
    """`specdec bench --json-schema FILE` (tiny pair, 2 prompts): one JSON object with the four arms, both
    speedups, forced tokens, equal constrained outputs and the grammar's cost per position."""
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--json-schema", str(schema), "--target",
                        str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir), "--limit", "2",
                        "--max-new-tokens", "16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["mode"] == "structured" and report["prompts"] == 2
    for arm in ("target_only", "speculative", "target_only_constrained", "speculative_constrained"):
        assert report[arm]["tokens"] > 0
    assert report["constrained_outputs_equal"] is True
    assert report["speculative_constrained"]["num_forced_tokens"] > 0  # '{"ok": ' is forced
    assert report["speedup_constrained"] > 0 and report["speedup_unconstrained"] > 0
    assert report["grammar_ms_per_position"] >= 0
