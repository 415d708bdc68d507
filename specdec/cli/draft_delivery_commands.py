"""`specdec draft publish|current|clear|list` (and ``publish --canary``): the drafts a verifier hands out to devices (``SPECDEC_DRAFTS_DIR``,
:mod:`cloud_verifier.drafts.catalog`; docs/security.md says what a device then holds)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from specdec.cli._shared import draft_app, fail

DRAFTS_DIR_HELP = "The verifier's drafts folder (env SPECDEC_DRAFTS_DIR)"


def _drafts_dir(drafts_dir: Optional[Path]) -> Path:
    import os

    chosen = drafts_dir or (Path(os.environ["SPECDEC_DRAFTS_DIR"]) if os.environ.get("SPECDEC_DRAFTS_DIR") else None)
    if chosen is None:
        fail("--drafts-dir (or SPECDEC_DRAFTS_DIR) is required")
    return chosen


@draft_app.command("publish")
def draft_publish(
    source: Path = typer.Argument(..., help="Draft folder (an ONNX draft: model.onnx, config.json, tokenizer files; "
                                  "or a draft head: specdec models export-head's head.onnx, head.json, ...)"),
    name: str = typer.Option(..., "--name", help="Draft name (e.g. smollm2-int8)"),
    version: str = typer.Option(..., "--version", help="Version id, new for this name (versions are immutable)"),
    drafts_dir: Optional[Path] = typer.Option(None, "--drafts-dir", help=DRAFTS_DIR_HELP),
    tenant: List[str] = typer.Option([], "--tenant", help="Only these tenants may fetch it (repeat); none = all"),
    current: bool = typer.Option(True, "--current/--no-current", help="Hand it out now (CURRENT) or only publish"),
    canary: Optional[str] = typer.Option(None, "--canary", help="Hand it to this fraction of clients first (e.g. "
                                         "10% or 0.1): promoted or rolled back from its measured acceptance"),
    baseline_from: Optional[Path] = typer.Option(None, "--baseline-from", help="A `specdec bench --json` report of "
                                                 "this draft against the served target: its acceptance rate is the "
                                                 "watchdog's baseline (default: the version's first verify steps)"),
):
    """Publish a draft version for delivery: files copied and hashed (SHA-256 manifest), then handed out to new
    clients at their next generation (unless --no-current), or first to a canary fraction of them."""
    from specdec_runtime.cloud_verifier.drafts.catalog import publish_draft, start_canary
    from specdec_runtime.cloud_verifier.security.auth import check_tenant_id
    from specdec_runtime.common.draft_manifest import ManifestError, kind_of_folder
    from specdec_runtime.common.paths import ModelNotFoundError, resolve_draft_dir

    root = _drafts_dir(drafts_dir)
    fraction = _fraction(canary) if canary is not None else None
    baseline = _bench_acceptance(baseline_from) if baseline_from is not None else None
    try:
        if kind_of_folder(source) == "head":  # a draft head (head.json): loadable, or nothing is published
            from specdec_runtime.edge_client.drafting.head_model import OnnxHead

            OnnxHead(source)
        else:
            resolve_draft_dir(source)  # an ONNX draft with its tokenizer, or nothing is published
        tenants = tuple(check_tenant_id(t) for t in tenant)
        root.mkdir(parents=True, exist_ok=True)
        manifest = publish_draft(source, root, name, version, tenants=tenants,
                                 make_current=current and fraction is None, baseline_acceptance_rate=baseline)
        if fraction is not None:
            start_canary(root, name, version, fraction)
    except (ManifestError, ModelNotFoundError, FileExistsError, ValueError, OSError) as e:
        fail(str(e))
    typer.echo(f"published {manifest.label} ({manifest.kind}): {len(manifest.files)} files, {manifest.size / 1e6:.1f} MB, digest "
               f"{manifest.digest[:16]}"
               + (f" (canary: {fraction:.0%} of clients)" if fraction is not None else "" if current
                  else " (not current)")
               + (f", tenants {', '.join(tenants)}" if tenants else ", every tenant")
               + (f", baseline acceptance {baseline:.3f}" if baseline is not None else ""))


def _bench_acceptance(path: Path) -> float:
    """The acceptance rate of a `specdec bench --json` report (``overall.acceptance_rate``, or a top-level
    ``acceptance_rate``); exits with one line when there is none in (0, 1]."""
    import json

    try:
        report = json.loads(path.read_text())
        rate = (report.get("overall") or {}).get("acceptance_rate", report.get("acceptance_rate"))
        rate = float(rate)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        fail(f"--baseline-from {path}: not a bench report with an acceptance rate ({e})")
    if not 0 < rate <= 1:
        fail(f"--baseline-from {path}: acceptance rate {rate} is not in (0, 1]")
    return rate


def _fraction(text: str) -> float:
    """0.1 from "10%" or "0.1"; exits with one line when it is not in (0, 1]."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        fail(f"--canary must be a fraction in (0, 1] or a percentage (e.g. 10%), got {text!r}")
    return value


@draft_app.command("current")
def draft_current(
    name: str = typer.Argument(..., help="Draft name"),
    version: str = typer.Argument(..., help="The version to hand out from now on (a rollback: an older one)"),
    drafts_dir: Optional[Path] = typer.Option(None, "--drafts-dir", help=DRAFTS_DIR_HELP),
):
    """Hand out another published version (clients take it at their next generation)."""
    from specdec_runtime.cloud_verifier.drafts.catalog import set_current
    from specdec_runtime.common.draft_manifest import ManifestError
    from specdec_runtime.common.errors import DraftNotFoundError

    try:
        set_current(_drafts_dir(drafts_dir), name, version)
    except (ManifestError, DraftNotFoundError, OSError) as e:
        fail(str(e))
    typer.echo(f"{name}: handing out {version}")


@draft_app.command("clear")
def draft_clear(
    name: str = typer.Argument(..., help="Draft name"),
    version: str = typer.Argument(..., help="The quarantined version to hand out again"),
    drafts_dir: Optional[Path] = typer.Option(None, "--drafts-dir", help=DRAFTS_DIR_HELP),
):
    """Take a version out of the watchdog's quarantine (clients take it again at their next generation)."""
    from specdec_runtime.cloud_verifier.drafts.catalog import read_quarantined, set_quarantine
    from specdec_runtime.common.draft_manifest import ManifestError

    root = _drafts_dir(drafts_dir)
    if version not in read_quarantined(root / name):
        fail(f"{name}@{version} is not quarantined")
    try:
        set_quarantine(root, name, version, None)
    except (ManifestError, OSError) as e:
        fail(str(e))
    typer.echo(f"{name}@{version}: out of quarantine")


@draft_app.command("list")
def draft_list(drafts_dir: Optional[Path] = typer.Option(None, "--drafts-dir", help=DRAFTS_DIR_HELP)):
    """The published versions (newest first), the one handed out marked *."""
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog

    try:
        catalog = DraftCatalog(_drafts_dir(drafts_dir))
    except ValueError as e:
        fail(str(e))
    canaries = catalog.canaries()
    for m in catalog.list_all():
        mark = "*" if catalog.current(m.name) == m.version else " "
        who = ", ".join(m.tenants) if m.tenants else "every tenant"
        trial = canaries.get(m.name)
        canary = f"  canary {trial[1]:.0%}" if trial is not None and trial[0] == m.version else ""
        why = catalog.quarantined(m.name).get(m.version)
        typer.echo(f"{mark} {m.label}  {m.size / 1e6:.1f} MB  {who}{canary}"
                   + (f"  QUARANTINED: {why}" if why else ""))
