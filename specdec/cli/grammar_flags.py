"""The structured-output flags of `generate`: ``--json-schema FILE``, ``--regex PATTERN``, ``--grammar FILE``
(Lark or GBNF), at most one, turned into the SDK's ``grammar`` option (:class:`common.grammar.GrammarSpec` as
JSON). Checked before any model loads, in one line: a file that cannot be read, a schema that is not JSON, and
what the grammar engine refuses (:meth:`common.grammar.GrammarSpec.check`, no tokenizer needed); the verifier
checks again at OpenSession. docs/structured-output.md."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specdec.cli._shared import fail

JSON_SCHEMA = typer.Option(None, "--json-schema", help="Constrain the output to this JSON schema (a file)")
REGEX = typer.Option(None, "--regex", help="Constrain the output to match this regular expression")
GRAMMAR = typer.Option(None, "--grammar", help="Constrain the output to this grammar (a Lark or GBNF file)")


def _read(path: Path, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        fail(f"{flag}: cannot read {path}: {e.strerror if isinstance(e, OSError) else e}")


def grammar_options(json_schema: Optional[Path], regex: Optional[str], grammar: Optional[Path]) -> dict:
    """``{"grammar": spec JSON}`` for the one flag given, ``{}`` for none; exits with one line otherwise."""
    from specdec_runtime.common.grammar import GrammarSpec

    given = [name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
             if v is not None]
    if len(given) > 1:
        fail(f"{' and '.join(given)}: give at most one of --json-schema, --regex, --grammar")
    try:
        if json_schema is not None:
            spec = GrammarSpec.json_schema(_read(json_schema, "--json-schema"))
        elif regex is not None:
            spec = GrammarSpec("regex", regex)
        elif grammar is not None:
            spec = GrammarSpec("grammar", _read(grammar, "--grammar"))
        else:
            return {}
        spec.check()  # what the engine refuses, without a model
    except ValueError as e:
        fail(f"{given[0]}: {e}")
    return {"grammar": spec.to_json()}
