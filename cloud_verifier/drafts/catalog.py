"""The drafts a verifier hands out: a folder per draft version, each with its manifest (common.draft_manifest).

Layout under the catalog's root (``SPECDEC_DRAFTS_DIR``)::

    <root>/<name>/<version>/specdec-draft.json     the manifest (files, sizes, SHA-256, optional tenants)
    <root>/<name>/<version>/model.onnx ...         the files it lists (the tokenizer files among them)
    <root>/<name>/CURRENT                          the version handed out now (one line); absent = the
                                                   version published last (its manifest's mtime)

:func:`publish_draft` (``specdec draft publish``) writes a version there: files copied into a hidden temporary
folder, hashed, the manifest written, then renamed into place and ``CURRENT`` replaced atomically, so a reader
never sees half a version. The catalog re-reads the folder at most once per ``rescan_interval_s``; a version
whose manifest is malformed or whose files are missing or of another size is skipped (logged once), never served.

Tenants: a version whose manifest lists ``tenants`` is offered only to those (API keys, cloud_verifier.security.auth);
to any other caller it does not exist (NOT_FOUND, as another tenant's session).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from specdec_runtime.common.draft_manifest import (MANIFEST_FILE, DraftManifest, ManifestError, check_id,
                                                   manifest_of_folder, parse_manifest)
from specdec_runtime.common.errors import DraftNotFoundError

log = logging.getLogger(__name__)

CURRENT_FILE = "CURRENT"


@dataclass(frozen=True)
class DraftVersion:
    """A servable draft version: its manifest, its folder, and when it was published (manifest mtime, s)."""

    manifest: DraftManifest
    folder: Path
    published_at: float


class DraftCatalog:
    """The draft versions under ``root`` (see the module docstring).

    Args:
        root: the drafts folder.
        default_name: the draft :meth:`resolve` answers when the caller names none; None = the first name (sorted)
            the caller may fetch.
        rescan_interval_s: the folder is re-read at most this often, s (0 = on every call).

    Raises:
        ValueError: ``root`` is not a folder.
    """

    def __init__(self, root: str | os.PathLike, *, default_name: str | None = None,
                 rescan_interval_s: float = 1.0):
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"drafts folder {self.root} does not exist")
        self.default_name = default_name
        self.rescan_interval_s = rescan_interval_s
        self._lock = threading.Lock()
        self._versions: dict[str, list[DraftVersion]] = {}  # name -> versions, newest published first
        self._current: dict[str, str] = {}  # name -> version handed out now
        self._next_scan = 0.0
        self._warned: set[str] = set()
        self.rescan()

    # ------------------------------------------------------------------ reading the folder
    def rescan(self) -> None:
        """Re-read the folder now."""
        versions: dict[str, list[DraftVersion]] = {}
        current: dict[str, str] = {}
        for name_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            found = [v for v in (self._read_version(d) for d in name_dir.iterdir()
                                 if d.is_dir() and not d.name.startswith(".")) if v is not None]
            found = [v for v in found if v.manifest.name == name_dir.name]
            if not found:
                continue
            found.sort(key=lambda v: (v.published_at, v.manifest.version), reverse=True)
            versions[name_dir.name] = found
            wanted = _read_current(name_dir)
            current[name_dir.name] = (wanted if any(v.manifest.version == wanted for v in found)
                                      else found[0].manifest.version)
        with self._lock:
            self._versions, self._current = versions, current
            self._next_scan = time.monotonic() + self.rescan_interval_s

    def _read_version(self, folder: Path) -> DraftVersion | None:
        path = folder / MANIFEST_FILE
        try:
            manifest = parse_manifest(path.read_text(), str(path))
            for f in manifest.files:
                size = (folder / f.path).stat().st_size
                if size != f.size:
                    raise ManifestError(f"{folder / f.path} is {size} bytes, its manifest says {f.size}")
            return DraftVersion(manifest, folder, path.stat().st_mtime)
        except (OSError, ManifestError) as e:
            if str(folder) not in self._warned:
                self._warned.add(str(folder))
                log.warning("draft version %s not served: %s", folder, e)
            return None

    def _maybe_rescan(self) -> None:
        if time.monotonic() >= self._next_scan:
            self.rescan()

    # ------------------------------------------------------------------ answers
    def list(self, tenant: str = "") -> list[DraftManifest]:
        """Every version ``tenant`` may fetch, by name, newest published first."""
        self._maybe_rescan()
        with self._lock:
            return [v.manifest for name in sorted(self._versions) for v in self._versions[name]
                    if v.manifest.allows(tenant)]

    def list_all(self) -> list[DraftManifest]:
        """Every servable version, whoever may fetch it (the operator's view)."""
        self._maybe_rescan()
        with self._lock:
            return [v.manifest for name in sorted(self._versions) for v in self._versions[name]]

    def current(self, name: str) -> str | None:
        """The version handed out for ``name`` now (None: no such draft)."""
        self._maybe_rescan()
        with self._lock:
            return self._current.get(name)

    def resolve(self, tenant: str = "", name: str = "") -> DraftManifest:
        """The version ``tenant`` should draft with now: ``name``'s current version (``CURRENT``), or the newest
        one it may fetch when the current one is not its; ``name`` "" = :attr:`default_name` or the first
        name it may fetch.

        Raises:
            DraftNotFoundError: nothing offered to ``tenant`` (under that name).
        """
        self._maybe_rescan()
        with self._lock:
            names = [name] if name else ([self.default_name] if self.default_name else sorted(self._versions))
            for n in names:
                allowed = [v for v in self._versions.get(n, ()) if v.manifest.allows(tenant)]
                if allowed:
                    current = self._current.get(n)
                    return next((v.manifest for v in allowed if v.manifest.version == current),
                                allowed[0].manifest)
        raise DraftNotFoundError(f"no draft named {name} is offered here" if name else "no draft is offered here")

    def version(self, name: str, version: str, tenant: str = "") -> DraftVersion:
        """A version ``tenant`` may fetch.

        Raises:
            DraftNotFoundError: unknown, or not offered to ``tenant`` (the same message).
        """
        self._maybe_rescan()
        with self._lock:
            for v in self._versions.get(name, ()):
                if v.manifest.version == version and v.manifest.allows(tenant):
                    return v
        raise DraftNotFoundError(f"no draft {name}@{version} is offered here")


def _read_current(name_dir: Path) -> str | None:
    try:
        return (name_dir / CURRENT_FILE).read_text().strip() or None
    except OSError:
        return None


def publish_draft(source: str | os.PathLike, root: str | os.PathLike, name: str, version: str, *,
                  tenants: tuple[str, ...] = (), kind: str = "onnx", make_current: bool = True) -> DraftManifest:
    """Copy the draft folder ``source`` into ``root/name/version`` with its manifest (every file hashed), and make
    it the version handed out (``CURRENT``) unless ``make_current`` is False. Atomic: a temporary folder renamed
    into place.

    Raises:
        ManifestError: an invalid name or version, or nothing to publish.
        FileExistsError: that version exists already (versions are immutable: publish a new one).
        OSError: the files cannot be copied.
    """
    check_id(name, "name"), check_id(version, "version")
    src, name_dir = Path(source), Path(root) / name
    final = name_dir / version
    if final.exists():
        raise FileExistsError(f"draft {name}@{version} exists already in {root}: versions are immutable")
    name_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".publish-", dir=name_dir))
    try:
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src)
            if p.is_file() and p.name != MANIFEST_FILE and not any(s.startswith(".") for s in rel.parts):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, tmp / rel)
        manifest = manifest_of_folder(tmp, name, version, kind=kind, tenants=tenants)
        (tmp / MANIFEST_FILE).write_text(manifest.to_json())
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if make_current:
        set_current(root, name, version)
    return manifest


def set_current(root: str | os.PathLike, name: str, version: str) -> None:
    """Make ``version`` the one handed out for ``name`` (``CURRENT`` replaced atomically).

    Raises:
        DraftNotFoundError: no such version folder.
    """
    name_dir = Path(root) / check_id(name, "name")
    if not (name_dir / check_id(version, "version") / MANIFEST_FILE).is_file():
        raise DraftNotFoundError(f"no draft {name}@{version} in {root}")
    fd, tmp = tempfile.mkstemp(prefix=".current-", dir=name_dir)
    with os.fdopen(fd, "w") as f:
        f.write(version + "\n")
    os.replace(tmp, name_dir / CURRENT_FILE)
