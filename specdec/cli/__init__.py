"""The `specdec` command line (typer).

    specdec models prepare            make the default target + draft (offline, idempotent)
    specdec generate "PROMPT"         speculative decoding, streaming text (embedded verifier over loopback gRPC)
    specdec generate --server H:P     ... against a running verifier
    specdec chat                      multi-turn conversation in the terminal (/reset, /exit; pipe-able)
    specdec edge-serve [--port 8000]  OpenAI-compatible HTTP endpoint on the device (docs/openai.md)
    specdec serve                     run a verifier (gRPC, health, reflection, /metrics)
    specdec draft publish DIR ...     hand a draft version out to devices (serve --drafts-dir)
    specdec bench [--prompts FILE]     Spec-Bench-style benchmark (target-only vs specdec vs HF assisted)

`generate`, `chat` and `edge-serve` prepare the default models on first use (as `models prepare`).
Errors print one line (``error: ...``) and exit with status 2.
"""

from __future__ import annotations

from specdec.cli._shared import DEFAULT_MIN_CONFIDENCE, DEFAULT_PROMPTS, app
from specdec.cli.pipeline import build_pipeline, ensure_default_models

# each module registers its commands on `app` (in this order in --help)
from specdec.cli import generate_command, chat_command, serve_commands, bench_command  # noqa: F401, I001
from specdec.cli import models_commands, draft_delivery_commands  # noqa: F401

__all__ = ["DEFAULT_MIN_CONFIDENCE", "DEFAULT_PROMPTS", "app", "build_pipeline", "ensure_default_models", "main"]


def main() -> None:
    """The ``specdec`` command: the typer app, with its usage errors (an unknown option, a value that is not a
    number) as one ``error: ...`` line and exit status 2, like every other argument error (typer would draw a
    multi-line panel)."""
    import sys

    from typer import Abort, TyperException
    from typer.main import get_command

    try:
        rv = get_command(app).main(standalone_mode=False)
    except TyperException as e:  # typer's click exceptions (usage errors among them) derive from it
        if type(e).__name__ == "NoArgsIsHelpError" or not hasattr(e, "format_message"):
            e.show()  # `specdec` alone: the help, as before
        else:
            print(f"error: {e.format_message()}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2))
    except Abort:  # Ctrl-C outside a command's own handling
        print("aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
