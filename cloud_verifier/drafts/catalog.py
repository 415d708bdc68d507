"""The drafts a verifier hands out: a folder per draft version, each with its manifest (common.draft_manifest).

Layout under the catalog's root (``SPECDEC_DRAFTS_DIR``)::

    <root>/<name>/<version>/specdec-draft.json     the manifest (files, sizes, SHA-256, optional tenants)
    <root>/<name>/<version>/model.onnx ...         the files it lists (the tokenizer files among them)
    <root>/<name>/CURRENT                          the version handed out now (one line); absent = the
                                                   version published last (its manifest's mtime)
    <root>/<name>/CANARY                           a version handed to a fraction of clients instead (JSON:
                                                   version, fraction), until it is promoted or rolled back
                                                   (:mod:`cloud_verifier.drafts.canary`)
    <root>/<name>/ROLLED_BACK                      versions rolled back (one a line): never a canary again
    <root>/<name>/QUARANTINED                      versions quarantined by the watchdog (JSON: version ->
                                                   {tenant: why}; "*" = every tenant): that tenant's clients get
                                                   the previous good version, or the current one with the
                                                   reason (they run on the cloud route)

:func:`publish_draft` (``specdec draft publish``) writes a version there: files copied into a hidden temporary
folder, hashed, the manifest written, then renamed into place and ``CURRENT`` replaced atomically, so a reader
never sees half a version. The catalog re-reads the folder at most once per ``rescan_interval_s``; a version
whose manifest is malformed or whose files are missing or of another size is skipped (logged once), never served.

Tenants: a version whose manifest lists ``tenants`` is offered only to those (API keys, cloud_verifier.security.auth);
to any other caller it does not exist (NOT_FOUND, as another tenant's session).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import random
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
CANARY_FILE = "CANARY"
QUARANTINE_FILE = "QUARANTINED"
ALL_TENANTS = "*"  # a quarantine for every tenant (QUARANTINED)
ROLLED_BACK_FILE = "ROLLED_BACK"


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
        rescan_interval_s: the folder is re-read at most this often, s (0 = on every call); canaries are judged
            at most this often too (:mod:`cloud_verifier.drafts.canary`).
        canary_min_blocks, canary_margin: a canary's decision rule (:class:`~cloud_verifier.drafts.canary.CanaryJudge`).
        watchdog_margin: acceptance below a version's baseline by more than this quarantines it
            (:class:`~cloud_verifier.drafts.watchdog.Watchdog`).

    Raises:
        ValueError: ``root`` is not a folder.
    """

    def __init__(self, root: str | os.PathLike, *, default_name: str | None = None,
                 rescan_interval_s: float = 1.0, canary_min_blocks: int = 200, canary_margin: float = 0.05,
                 watchdog_margin: float = 0.2):
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"drafts folder {self.root} does not exist")
        self.default_name = default_name
        self.rescan_interval_s = rescan_interval_s
        self.canary_min_blocks, self.canary_margin = canary_min_blocks, canary_margin
        self.watchdog_margin = watchdog_margin
        # (client_id, name, version, fraction) -> whether that client gets the canary; the verifier sets a fair
        # one shared by its replicas (cloud_verifier.drafts.canary.CanaryAssignment)
        self.assign_canary = in_canary
        self._lock = threading.Lock()
        self._versions: dict[str, list[DraftVersion]] = {}  # name -> versions, newest published first
        self._current: dict[str, str] = {}  # name -> version handed out now
        self._canary: dict[str, tuple[str, float]] = {}  # name -> (canary version, fraction of clients)
        self._quarantined: dict[str, dict[str, dict[str, str]]] = {}  # name -> {version: {tenant: why}}
        self._next_scan = 0.0
        self._warned: set[str] = set()
        self.rescan()

    # ------------------------------------------------------------------ reading the folder
    def rescan(self) -> None:
        """Re-read the folder now."""
        versions: dict[str, list[DraftVersion]] = {}
        current: dict[str, str] = {}
        canary: dict[str, tuple[str, float]] = {}
        quarantined: dict[str, dict[str, dict[str, str]]] = {}
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
            quarantined[name_dir.name] = read_quarantined(name_dir)
            trial = read_canary(name_dir)
            if trial is not None and any(v.manifest.version == trial[0] for v in found):
                canary[name_dir.name] = trial
        with self._lock:
            self._versions, self._current, self._canary = versions, current, canary
            self._quarantined = quarantined
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

    def quarantined(self, name: str, tenant: str | None = None) -> dict[str, str]:
        """``name``'s versions quarantined for ``tenant`` (for any tenant: None) and why."""
        self._maybe_rescan()
        with self._lock:
            return quarantined_for(self._quarantined.get(name, {}), tenant)

    def quarantine_states(self, name: str) -> dict[str, dict[str, str]]:
        """``name``'s quarantines: version -> {tenant ("*" = every tenant): why}."""
        self._maybe_rescan()
        with self._lock:
            return {v: dict(t) for v, t in self._quarantined.get(name, {}).items()}

    def canaries(self) -> dict[str, tuple[str, float]]:
        """name -> (canary version, fraction of clients) of every canary running."""
        self._maybe_rescan()
        with self._lock:
            return dict(self._canary)

    def resolve(self, tenant: str = "", name: str = "", client_id: str = "") -> DraftManifest:
        """The version ``tenant`` should draft with now: ``name``'s current version (``CURRENT``), or the newest
        one it may fetch when the current one is not its; a running canary instead for the clients its fraction
        covers (:attr:`assign_canary`: sticky per ``client_id``; "" = drawn at random); ``name`` "" =
        :attr:`default_name` or the first name it may fetch.

        Raises:
            DraftNotFoundError: nothing offered to ``tenant`` (under that name).
        """
        self._maybe_rescan()
        with self._lock:
            names = [name] if name else ([self.default_name] if self.default_name else sorted(self._versions))
            found = None
            for n in names:
                allowed = [v for v in self._versions.get(n, ()) if v.manifest.allows(tenant)]
                if allowed:
                    found = (n, allowed, self._current.get(n), self._canary.get(n),
                             quarantined_for(self._quarantined.get(n, {}), tenant))
                    break
        if found is not None:
            n, allowed, current, trial, bad = found
            # outside the lock: a shared assignment asks Redis
            if trial is not None and trial[0] != current and trial[0] not in bad and self.assign_canary(
                    client_id, n, *trial):
                current = trial[0]
            return self._good(allowed, current, bad)
        raise DraftNotFoundError(f"no draft named {name} is offered here" if name else "no draft is offered here")

    @staticmethod
    def _good(allowed: list[DraftVersion], wanted: str | None, bad: dict[str, str]) -> DraftManifest:
        """``wanted`` among ``allowed`` (newest first); when it is quarantined, the newest version published
        before it that is not, else ``wanted`` with its quarantine reason."""
        at = next((i for i, v in enumerate(allowed) if v.manifest.version == wanted), 0)
        chosen = allowed[at].manifest
        if chosen.version not in bad:
            return chosen
        fallback = next((v.manifest for v in allowed[at + 1:] if v.manifest.version not in bad), None)
        return fallback or dataclasses.replace(chosen, quarantine_reason=bad[chosen.version])

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
                  tenants: tuple[str, ...] = (), kind: str | None = None, make_current: bool = True,
                  baseline_acceptance_rate: float | None = None) -> DraftManifest:
    """Copy the draft folder ``source`` into ``root/name/version`` with its manifest (every file hashed), and make
    it the version handed out (``CURRENT``) unless ``make_current`` is False. Atomic: a temporary folder renamed
    into place. ``kind``: "onnx" (an ONNX draft model) or "head" (a draft head folder); None = from the folder
    (:func:`~common.draft_manifest.kind_of_folder`). ``baseline_acceptance_rate``: its publish-time benchmark's
    acceptance rate, the watchdog's baseline (None: its first verify steps).

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
        manifest = manifest_of_folder(tmp, name, version, kind=kind, tenants=tenants,
                                      baseline_acceptance_rate=baseline_acceptance_rate)
        (tmp / MANIFEST_FILE).write_text(manifest.to_json())
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if make_current:
        set_current(root, name, version)
    return manifest


def in_canary(client_id: str, name: str, version: str, fraction: float) -> bool:
    """Whether the client ``client_id`` gets canary ``version`` of ``name``: SHA-256 of the three, as a number in
    [0, 1), below ``fraction`` (sticky: the same client gets the same answer for the canary's whole run; another
    canary draws anew); no ``client_id``: a random draw."""
    if not client_id:
        return random.random() < fraction
    digest = hashlib.sha256(f"{client_id}\0{name}\0{version}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < fraction


def read_canary(name_dir: Path) -> tuple[str, float] | None:
    """``(version, fraction)`` of the canary running for a draft's folder, None when none (or unreadable, or a
    version rolled back)."""
    try:
        raw = json.loads((name_dir / CANARY_FILE).read_text())
        version, fraction = str(raw["version"]), float(raw["fraction"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None if version in rolled_back(name_dir) or not 0 < fraction <= 1 else (version, fraction)


def rolled_back(name_dir: Path) -> set[str]:
    """The versions of a draft's folder that were rolled back."""
    try:
        return {line.strip() for line in (name_dir / ROLLED_BACK_FILE).read_text().splitlines() if line.strip()}
    except OSError:
        return set()


def start_canary(root: str | os.PathLike, name: str, version: str, fraction: float) -> None:
    """Hand ``version`` to ``fraction`` (0 < f <= 1) of the clients that resolve ``name`` (``CANARY``, atomic).

    Raises:
        DraftNotFoundError: no such version. ValueError: a fraction outside (0, 1].
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"canary fraction must be in (0, 1], got {fraction}")
    name_dir = Path(root) / check_id(name, "name")
    if not (name_dir / check_id(version, "version") / MANIFEST_FILE).is_file():
        raise DraftNotFoundError(f"no draft {name}@{version} in {root}")
    _write_atomic(name_dir, CANARY_FILE, json.dumps({"version": version, "fraction": fraction}) + "\n")


def end_canary(root: str | os.PathLike, name: str, promote: bool) -> str | None:
    """End ``name``'s canary: promoted (made ``CURRENT``) or rolled back (listed in ``ROLLED_BACK``, never a
    canary again). Returns its version, None when none was running."""
    name_dir = Path(root) / check_id(name, "name")
    with _folder_lock(name_dir):  # replicas sharing the folder: the first decides, the others find no canary
        trial = read_canary(name_dir)
        if trial is None:
            return None
        if promote:
            set_current(root, name, trial[0])
        else:
            with open(name_dir / ROLLED_BACK_FILE, "a") as f:
                f.write(trial[0] + "\n")
        (name_dir / CANARY_FILE).unlink(missing_ok=True)
        return trial[0]


def read_quarantined(name_dir: Path) -> dict[str, dict[str, str]]:
    """The quarantines of a draft's folder: version -> {tenant ("*" = every tenant): why} ({} when none or
    unreadable; a version mapped to a plain reason is quarantined for every tenant)."""
    try:
        raw = json.loads((name_dir / QUARANTINE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {str(v): ({str(t): str(w) for t, w in why.items()} if isinstance(why, dict) else {ALL_TENANTS: str(why)})
            for v, why in raw.items() if why}


def quarantined_for(states: dict[str, dict[str, str]], tenant: str | None) -> dict[str, str]:
    """version -> why of the versions in ``states`` (:func:`read_quarantined`) quarantined for ``tenant`` (its
    own or every tenant's); ``tenant`` None: for any tenant (the first reason)."""
    out = {}
    for version, tenants in states.items():
        why = (next(iter(tenants.values()), None) if tenant is None
               else tenants.get(tenant, tenants.get(ALL_TENANTS)))
        if why is not None:
            out[version] = why
    return out


def set_quarantine(root: str | os.PathLike, name: str, version: str, reason: str | None,
                   tenant: str = ALL_TENANTS) -> bool:
    """Quarantine ``version`` of ``name`` for ``tenant`` ("*" = every tenant) with ``reason``, or clear it
    (``reason`` None; for "*": every tenant's quarantine of the version). Atomic, and serialised between
    replicas sharing the folder (a lock file): returns whether it changed anything (the replica that did it
    counts the decision)."""
    name_dir = Path(root) / check_id(name, "name")
    check_id(version, "version")
    with _folder_lock(name_dir):
        states = read_quarantined(name_dir)
        before = json.dumps(states, sort_keys=True)
        if reason is None and tenant == ALL_TENANTS:
            states.pop(version, None)
        elif reason is None:
            states.get(version, {}).pop(tenant, None)
        else:
            states.setdefault(version, {})[tenant] = reason
        states = {v: t for v, t in states.items() if t}
        if json.dumps(states, sort_keys=True) == before:
            return False
        _write_atomic(name_dir, QUARANTINE_FILE, json.dumps(states, indent=1, sort_keys=True) + "\n")
        return True


@contextlib.contextmanager
def _folder_lock(name_dir: Path):
    """An exclusive lock on a draft's folder (``.lock``), for read-modify-write of its state files."""
    with open(name_dir / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomic(folder: Path, name: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{name.lower()}-", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, folder / name)


def set_current(root: str | os.PathLike, name: str, version: str) -> None:
    """Make ``version`` the one handed out for ``name`` (``CURRENT`` replaced atomically).

    Raises:
        DraftNotFoundError: no such version folder.
    """
    name_dir = Path(root) / check_id(name, "name")
    if not (name_dir / check_id(version, "version") / MANIFEST_FILE).is_file():
        raise DraftNotFoundError(f"no draft {name}@{version} in {root}")
    _write_atomic(name_dir, CURRENT_FILE, version + "\n")
