"""`specdec generate --json-schema/--regex/--grammar`: refused in one line before any model loads (two flags, a
file that cannot be read, a schema that is not JSON); the options become the SDK's grammar."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.grammar import GrammarSpec
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
