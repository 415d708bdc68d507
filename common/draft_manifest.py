"""What a delivered draft is: a manifest naming a draft version's files with their sizes and SHA-256 digests.

Both sides use it: the verifier reads the manifest of each draft version it hands out
(:mod:`cloud_verifier.drafts.catalog`), the edge checks every downloaded file against it
(:mod:`edge_client.delivery.cache`). On disk a draft version is a folder holding its files (for ``kind`` "onnx":
``model.onnx``, its data, ``config.json``, the tokenizer files; for ``kind`` "head", a draft head as
``specdec models export-head`` writes it: ``head.onnx``, ``head.json``, optional ``fuse.onnx`` and ``d2t.npy``, the
tokenizer files) and :data:`MANIFEST_FILE`::

    {"name": "smollm2-int8", "version": "2026-12-07.1", "kind": "onnx", "tenants": ["acme"],
     "files": [{"path": "model.onnx", "size": 1234, "sha256": "ab..."}, ...]}

``tenants`` (optional, verifier side only, never sent): the tenants that may fetch it; absent or empty = every
tenant. The version's identity is :attr:`DraftManifest.digest`, a SHA-256 over every file's path, size and
digest, so an edge can tell two versions of the same name and version string apart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

MANIFEST_FILE = "specdec-draft.json"
DRAFT_KINDS = ("onnx", "head")  # an ONNX draft model; a draft head (head.onnx + head.json: edge_client.drafting.head_model)
HEAD_CONFIG_FILE = "head.json"  # a draft head folder's config (specdec models export-head)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json",
                   "config.json")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_HASH_BLOCK = 1 << 20


class ManifestError(ValueError):
    """A malformed manifest or draft folder (one line naming what is wrong)."""


@dataclass(frozen=True)
class DraftFile:
    """One file of a draft version: ``path`` relative to the version's folder ("/"-separated), ``size`` in bytes,
    ``sha256`` lowercase hex."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class DraftManifest:
    """A draft version: ``name`` and ``version`` (operator-chosen ids), ``kind`` (what loads it: "onnx"),
    ``files``, and ``tenants`` (who may fetch it; empty = everyone; verifier side only);
    ``baseline_acceptance_rate``: the acceptance rate its publish-time benchmark measured against this target (the
    watchdog's baseline instead of the version's first verify steps; None = those; verifier side only)."""

    name: str
    version: str
    kind: str
    files: tuple[DraftFile, ...]
    tenants: tuple[str, ...] = field(default=())
    baseline_acceptance_rate: float | None = field(default=None, compare=False)
    # ResolveDraft's answer only: why the version handed out is quarantined ("" = it is not); not its identity
    quarantine_reason: str = field(default="", compare=False)

    @property
    def size(self) -> int:
        """Sum of the files' sizes, bytes."""
        return sum(f.size for f in self.files)

    @property
    def digest(self) -> str:
        """SHA-256 (hex) over ``path\\0size\\0sha256\\n`` of every file in order: the version's identity."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
        return h.hexdigest()

    @property
    def label(self) -> str:
        """``name@version`` (logs, metrics)."""
        return f"{self.name}@{self.version}"

    def file(self, path: str) -> DraftFile | None:
        """The file at ``path``, or None."""
        return next((f for f in self.files if f.path == path), None)

    def allows(self, tenant: str) -> bool:
        """Whether ``tenant`` ("" = unauthenticated) may fetch this version."""
        return not self.tenants or tenant in self.tenants

    def to_json(self) -> str:
        extra = ({} if self.baseline_acceptance_rate is None
                 else {"baseline_acceptance_rate": self.baseline_acceptance_rate})
        return json.dumps({"name": self.name, "version": self.version, "kind": self.kind,
                           "tenants": list(self.tenants), **extra,
                           "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files]},
                          indent=1)


def check_id(value: str, what: str) -> str:
    """``value`` if it is a valid draft name or version (1-128 of ``A-Z a-z 0-9 . _ -``, starting alphanumeric).

    Raises:
        ManifestError: it is not.
    """
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ManifestError(f"invalid draft {what} {value!r}: 1-128 characters of A-Z a-z 0-9 . _ -, starting "
                            "with a letter or digit")
    return value


def check_rate(value: float) -> float:
    """``value`` if it is an acceptance rate (0 < r <= 1).

    Raises:
        ManifestError: it is not."""
    if not 0 < value <= 1:
        raise ManifestError(f"a baseline acceptance rate must be in (0, 1], got {value}")
    return value


def check_relative_path(path: str) -> str:
    """``path`` if it is a safe relative "/"-separated path inside a draft folder (no "..", not absolute, no
    backslash).

    Raises:
        ManifestError: it is not.
    """
    p = PurePosixPath(path)
    if (not path or "\\" in path or p.is_absolute() or any(part in ("..", ".", "") for part in path.split("/"))
            or path == MANIFEST_FILE):
        raise ManifestError(f"invalid draft file path {path!r}")
    return path


def sha256_file(path: str | os.PathLike) -> str:
    """Lowercase hex SHA-256 of a file's bytes (read in 1 MiB pieces)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(_HASH_BLOCK):
            h.update(piece)
    return h.hexdigest()


def parse_manifest(text: str, source: str = "draft manifest") -> DraftManifest:
    """A manifest from its JSON text.

    Raises:
        ManifestError: malformed (bad JSON, missing or invalid fields, unsafe or repeated paths).
    """
    try:
        raw = json.loads(text)
        files = tuple(DraftFile(check_relative_path(str(f["path"])), int(f["size"]), str(f["sha256"]).lower())
                      for f in raw["files"])
        baseline = raw.get("baseline_acceptance_rate")
        manifest = DraftManifest(check_id(raw["name"], "name"), check_id(str(raw["version"]), "version"),
                                 str(raw.get("kind", "onnx")), files, tuple(str(t) for t in raw.get("tenants") or ()),
                                 None if baseline is None else check_rate(float(baseline)))
    except ManifestError as e:
        raise ManifestError(f"{source}: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{source}: not a draft manifest ({type(e).__name__}: {e})") from None
    if manifest.kind not in DRAFT_KINDS:
        raise ManifestError(f"{source}: unknown draft kind {manifest.kind!r} (known: {', '.join(DRAFT_KINDS)})")
    if not files or any(f.size < 0 or not _SHA_RE.match(f.sha256) for f in files):
        raise ManifestError(f"{source}: files need a size >= 0 and a 64-hex-digit sha256")
    if len({f.path for f in files}) != len(files):
        raise ManifestError(f"{source}: a file is listed twice")
    return manifest


def kind_of_folder(folder: str | os.PathLike) -> str:
    """"head" for a draft head folder (it holds :data:`HEAD_CONFIG_FILE`), else "onnx"."""
    return "head" if (Path(folder) / HEAD_CONFIG_FILE).is_file() else "onnx"


def manifest_of_folder(folder: str | os.PathLike, name: str, version: str, *, kind: str | None = None,
                       tenants: tuple[str, ...] = (), baseline_acceptance_rate: float | None = None) -> DraftManifest:
    """The manifest of every regular file under ``folder`` (sorted by path; the manifest file itself and hidden
    files left out), each hashed; ``kind`` None = :func:`kind_of_folder`; ``baseline_acceptance_rate``: the
    version's publish-time baseline (:class:`DraftManifest`).

    Raises:
        ManifestError: an invalid name/version, an unknown kind, a baseline outside (0, 1], or an empty folder.
    """
    root = Path(folder)
    files = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if not p.is_file() or rel == MANIFEST_FILE or any(part.startswith(".") for part in rel.split("/")):
            continue
        files.append(DraftFile(check_relative_path(rel), p.stat().st_size, sha256_file(p)))
    if not files:
        raise ManifestError(f"no files to publish in {root}")
    kind = kind_of_folder(root) if kind is None else kind
    if kind not in DRAFT_KINDS:
        raise ManifestError(f"unknown draft kind {kind!r} (known: {', '.join(DRAFT_KINDS)})")
    baseline = None if baseline_acceptance_rate is None else check_rate(float(baseline_acceptance_rate))
    return DraftManifest(check_id(name, "name"), check_id(version, "version"), kind, tuple(files), tuple(tenants),
                         baseline)


def manifest_to_proto(manifest: DraftManifest):
    """The wire form (``specdec.v1.DraftManifest``; ``tenants`` is never sent)."""
    from specdec_runtime.common.v1 import verifier_pb2 as pb

    return pb.DraftManifest(name=manifest.name, version=manifest.version, kind=manifest.kind,
                            files=[pb.DraftFile(path=f.path, size=f.size, sha256=f.sha256) for f in manifest.files],
                            size=manifest.size, digest=manifest.digest,
                            quarantine_reason=manifest.quarantine_reason)


def manifest_from_proto(message) -> DraftManifest:
    """A manifest from its wire form, checked as a manifest file is (paths, digests).

    Raises:
        ManifestError: malformed, or its digest is not the one its files give.
    """
    manifest = parse_manifest(json.dumps({
        "name": message.name, "version": message.version, "kind": message.kind or "onnx",
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in message.files]}),
        "draft manifest from the verifier")
    if message.digest and message.digest != manifest.digest:
        raise ManifestError("draft manifest from the verifier: its digest does not match its files")
    return dataclasses.replace(manifest, quarantine_reason=message.quarantine_reason)
