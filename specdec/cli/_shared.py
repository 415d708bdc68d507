"""What every `specdec` command shares: the typer apps, the environment defaults, one-line errors, device checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "spec_bench_dev.jsonl"  # Apache-2.0, data/README.md

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# idle OpenMP threads of torch must not busy-wait: on few cores they starve the draft model / other sessions
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# gRPC core's own log lines (handshake failures, one per retry) are no message for a user: the CLI names the cause
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# confidence truncation threshold of `generate` (0.3 cut τ from 4.7 to 3.3 with the int8 draft)
DEFAULT_MIN_CONFIDENCE = 0.1

# γ, `-g`: one declaration for every command that drafts (generate, chat, edge-serve, bench); the range is checked
# by checks.check_num_speculative_tokens before anything loads. Use: `num_speculative_tokens: NumSpeculativeTokens
# = DEFAULT_NUM_SPECULATIVE_TOKENS`.
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
NumSpeculativeTokens = Annotated[int, typer.Option(
    "--num-speculative-tokens", "-g", help="γ: draft tokens per block (with adaptive γ: the most a block may have)")]

# --draft: one declaration for generate, chat and edge-serve (bench says more: its modes differ); the value is turned
# into a directory by checks.resolve_draft_option before anything loads. Use: `draft: DraftOption = None`.
DRAFT_HELP = ("Draft: a prepared draft's name, int8 (`specdec models prepare`), distilled (`specdec draft install`) or "
              "head (`specdec models prepare`), or a directory: an ONNX draft, or a draft head (head.json, `specdec "
              "models export-head`) (default: the prepared int8 draft)")
DraftOption = Annotated[Optional[str], typer.Option("--draft", help=DRAFT_HELP)]

# --device-draft: the standalone draft that decodes on the device (--route device, --fallback device; edge-serve:
# a request's route device) instead of --draft, as the SDK's EdgeClient(device_drafter=...). Needed beside a draft
# head, which cannot decode alone; beside a draft that can, the device decodes with this one instead (e.g. a larger
# draft for unverified text). Resolved and checked by checks.resolve_device_draft. Use:
# `device_draft: DeviceDraftOption = None`.
DEVICE_DRAFT_HELP = ("Draft that decodes on the device (--route device, --fallback device) instead of --draft: "
                     "int8, distilled, or an ONNX draft directory (not a head: it cannot decode alone). Needed "
                     "for the device beside a draft head; beside another draft, the device decodes with this one "
                     "(default: --draft itself)")
DeviceDraftOption = Annotated[Optional[str], typer.Option("--device-draft", help=DEVICE_DRAFT_HELP)]

# Plain (click-style) help: typer's rich panels print a "<bool>" type column for every on/off flag (--help
# included), where click's layout shows a flag by its name alone.
HELP_STYLE = dict(rich_markup_mode=None, pretty_exceptions_enable=False)
app = typer.Typer(add_completion=False, no_args_is_help=True, help="specdec: edge-cloud speculative decoding",
                  **HELP_STYLE)


def _print_version(value: bool) -> None:
    if not value:
        return
    from specdec.distribution import version

    typer.echo(f"specdec {version() or '(not installed)'}")  # None: a source tree that is not installed
    raise typer.Exit()


@app.callback()
def _main(_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                        help="Print the version and exit")) -> None:
    """specdec: edge-cloud speculative decoding"""


models_app = typer.Typer(no_args_is_help=True, help="Prepare and inspect models", **HELP_STYLE)
app.add_typer(models_app, name="models")
draft_app = typer.Typer(no_args_is_help=True, help="Make draft models for a target", **HELP_STYLE)
app.add_typer(draft_app, name="draft")
from specdec.keys import keys_app  # noqa: E402 - `specdec keys create|list|revoke` (API keys, docs/security.md)

app.add_typer(keys_app, name="keys")

DEVICE_HELP = "auto (CUDA when available, else CPU), cpu, cuda, cuda:N"
DTYPE_HELP = "auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16"
SERVER_HELP = ("HOST:PORT of a running verifier, or several comma-separated (tried in order; a failed call moves to "
                "the next), or a load balancer (default: an embedded verifier)")
FALLBACK_HELP = ("'none' or 'device': when no verifier answers, keep decoding with the draft alone (unverified "
                  "tokens, counted and reported)")


def quiet_transformers() -> None:
    """No weight-loading progress bars or warnings from transformers on the CLI (errors still print)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def head_on_device_remedy(where: str) -> str:
    """What to do when ``where`` (``--route device``, ``--fallback device``) meets a draft head without
    ``--device-draft``: a head cannot decode alone, so the device needs a standalone draft beside it (the CLI's
    ``--device-draft``, the SDK's ``EdgeClient(device_drafter=...)``), or a draft that decodes alone as --draft."""
    other = "use another --route" if where.startswith("--route") else "drop --fallback device"
    return (f"give --device-draft a draft that decodes alone (int8, distilled or an ONNX draft directory) to "
            f"decode on the device beside the head, or give --draft such a draft instead (without --draft: int8), "
            f"or {other}")


def explain(e: BaseException) -> str:
    """The one line of a user error, with what to do where the error alone does not say it."""
    from specdec_runtime.common.errors import UnauthenticatedError, UnsupportedByDrafterError

    if isinstance(e, UnauthenticatedError):
        return f"{e}: pass the verifier's key with --api-key KEY (or $SPECDEC_API_KEY)"
    if isinstance(e, UnsupportedByDrafterError) and e.head_on_device:
        # a head that reached the device (a delivered one): the SDK's remedy (device_drafter) is not the CLI's
        where = "--route device" if e.head_on_device == "route" else "--fallback device"
        return (f"{where} needs a draft that decodes alone; the draft is a draft head (it drafts from the "
                f"verifier's features): {head_on_device_remedy(where)}")
    return str(e)


# what each extra's side imports, by module name
_EXTRA_MODULES = {
    "verifier": ("torch", "transformers", "safetensors", "redis", "prometheus_client", "pydantic_settings",
                 "grpc_reflection"),
    "tools": ("torch", "transformers", "gguf", "onnx", "onnxscript", "accelerate"),
}


def require_extra(extra: str, what: str) -> None:
    """Exit with one line when specdec-edgecloud[``extra``] is not installed (e.g. an edge-only install): ``what`` needs
    it. Looks the modules up without importing them (torch takes seconds)."""
    import importlib.util

    missing = [m for m in _EXTRA_MODULES[extra] if importlib.util.find_spec(m) is None]
    if missing:
        elsewhere = ", or use a verifier elsewhere with --server HOST:PORT" if extra == "verifier" else ""
        from specdec.distribution import install_command

        fail(f"{what} needs specdec-edgecloud[{extra}] ({', '.join(missing)} not installed): "
             f"{install_command('all')}{elsewhere}")


def check_device(device: str, dtype: str) -> tuple[str, str]:
    """(device, dtype) names resolved (``auto`` included), or exit with one line (unknown name, no CUDA, no
    verifier packages)."""
    require_extra("verifier", "the embedded verifier (no --server)")
    from specdec_runtime.cloud_verifier.target.runner import resolve_device, resolve_dtype

    try:
        dev = resolve_device(device)
        return str(dev), str(resolve_dtype(dtype, dev)).replace("torch.", "")
    except ValueError as e:
        fail(str(e))


def user_errors():
    from specdec_runtime.common.errors import SpecdecError
    from specdec_runtime.common.paths import ModelNotFoundError
    from specdec_runtime.common.vocab import VocabMismatchError

    try:  # a target the verifier cannot run (embedded verifier): one line, not a traceback
        from specdec_runtime.cloud_verifier.target.architectures import UnsupportedArchitectureError
    except ImportError:  # an edge-only install has no verifier
        return (SpecdecError, ModelNotFoundError, VocabMismatchError)
    return (SpecdecError, ModelNotFoundError, VocabMismatchError, UnsupportedArchitectureError)


ROUTE_HELP = ("'speculative' (draft + verify), 'cloud' (the verifier generates and streams), 'device' (the draft "
              "alone, unverified), 'cloud-first' (the cloud streams while the draft prefills, then speculative) or "
              "'auto' (chosen and re-chosen from measurements; docs/routing.md)")


def check_route(route: str) -> None:
    """Exit with one line on an unknown --route (before any model loads)."""
    from specdec_runtime.edge_client.generation.routing import ROUTES

    if route not in ROUTES:
        fail(f"--route must be one of {', '.join(ROUTES)}, got {route!r}")
