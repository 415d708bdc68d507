"""`specdec keys`: API keys of a verifier (the key file of ``SPECDEC_API_KEYS_FILE``; cloud_verifier/security/auth.py).

    specdec keys create --tenant acme [--file F]   print a new key ONCE, append its SHA-256 to the file
    specdec keys list [--file F]                   tenants, and the first 12 hex digits of each key's hash
    specdec keys revoke --tenant acme [--file F]   remove the tenant's keys (or one: --hash-prefix P)

The file holds hashes only; a running verifier picks changes up within about a second. Errors print one line
(``error: ...``) and exit with status 2.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

import typer

# plain help, as the other commands' (specdec.cli._shared imports this module: no import back from there)
keys_app = typer.Typer(no_args_is_help=True, help="API keys of a verifier (hashes in SPECDEC_API_KEYS_FILE)",
                       rich_markup_mode=None, pretty_exceptions_enable=False)

FILE_ENV = "SPECDEC_API_KEYS_FILE"


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _key_file(file: Optional[Path]) -> Path:
    """The key file (``--file``, else ``$SPECDEC_API_KEYS_FILE``), or exit: none given, or a directory."""
    path = file or (Path(os.environ[FILE_ENV]) if os.environ.get(FILE_ENV) else None)
    if path is None:
        _fail(f"no key file: pass --file or set {FILE_ENV}")
    if path.is_dir():
        _fail(f"{_named(path, file)}: is a directory (give the key file's path)")
    return path


def _named(path: Path, file: Optional[Path]) -> str:
    """How the user named the key file: ``--file PATH`` or ``SPECDEC_API_KEYS_FILE=PATH``."""
    return f"--file {path}" if file else f"{FILE_ENV}={path}"


def _os_error(e: OSError, path: Path, file: Optional[Path]) -> str:
    return f"{_named(path, file)}: {(e.strerror or str(e)).lower()}"


def _read_entries(path: Path, file: Optional[Path]) -> list[tuple[str, str]]:
    from specdec_runtime.cloud_verifier.security.auth import parse_key_file

    try:
        return parse_key_file(path.read_text(), str(path))
    except FileNotFoundError:
        _fail(f"{path} does not exist")
    except OSError as e:
        _fail(_os_error(e, path, file))
    except ValueError as e:
        _fail(str(e))


@keys_app.command("create")
def keys_create(
    tenant: str = typer.Option(..., "--tenant", help="Tenant the key belongs to (1-64 of A-Z a-z 0-9 . _ -)"),
    file: Optional[Path] = typer.Option(None, "--file", help=f"Key file (default ${FILE_ENV}); created 0600"),
):
    """Make a new API key for a tenant: prints it once (stdout) and appends its SHA-256 hash to the key file."""
    from specdec_runtime.cloud_verifier.security.auth import append_api_key

    path = _key_file(file)
    try:
        key = append_api_key(path, tenant)
    except OSError as e:
        _fail(_os_error(e, path, file))
    except ValueError as e:
        _fail(str(e).splitlines()[0])
    typer.echo(key)
    typer.echo(f"added a key for tenant {tenant!r} to {path} (only its hash is stored: keep the key now, it is not "
               "shown again)", err=True)


@keys_app.command("list")
def keys_list(file: Optional[Path] = typer.Option(None, "--file", help=f"Key file (default ${FILE_ENV})")):
    """Tenants of the key file, with the first 12 hex digits of each key's hash."""
    for tenant, digest in _read_entries(_key_file(file), file):
        typer.echo(f"{tenant}\t{digest[:12]}")


@keys_app.command("revoke")
def keys_revoke(
    tenant: str = typer.Option(..., "--tenant", help="Tenant whose keys are removed"),
    hash_prefix: Optional[str] = typer.Option(None, "--hash-prefix", help="Only the key whose hash starts so"),
    file: Optional[Path] = typer.Option(None, "--file", help=f"Key file (default ${FILE_ENV})"),
):
    """Remove a tenant's keys (all, or the one matching --hash-prefix); the file is replaced atomically."""
    path = _key_file(file)
    entries = _read_entries(path, file)
    prefix = (hash_prefix or "").lower()
    gone = [(t, h) for t, h in entries if t == tenant and h.startswith(prefix)]
    if not gone:
        _fail(f"no key of tenant {tenant!r}{f' with hash prefix {prefix}' if prefix else ''} in {path}")
    if prefix and len(gone) > 1:
        _fail(f"hash prefix {prefix!r} matches {len(gone)} keys of {tenant!r}: give more digits")
    keep = [e for e in entries if e not in gone]
    fd, tmp = tempfile.mkstemp(prefix=".api_keys-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp: mode 0600
            f.write("# specdec API keys: 'tenant_id sha256(key)' per line (specdec keys create)\n")
            f.writelines(f"{t} {h}\n" for t, h in keep)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        _fail(f"cannot rewrite {path}: {e.strerror or e}")
    typer.echo(f"revoked {len(gone)} key(s) of tenant {tenant!r} in {path}", err=True)
