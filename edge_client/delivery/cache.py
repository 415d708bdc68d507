"""Where the edge keeps the drafts its verifier delivered, and the checks a downloaded file must pass.

Layout under the cache's root (default ``<specdec cache>/delivered-drafts``, :func:`common.paths.default_cache_dir`)::

    <root>/<name>/<version>-<digest[:16]>/        a complete version: every file checked, then renamed here
    <root>/<name>/<version>-<digest[:16]>/.specdec-complete    its manifest's digest (written last)
    <root>/<name>/.incoming-<digest[:16]>/        a version being downloaded: checked files under their names,
                                                  the file in progress as <path>.part (resumed from its size)

A file is kept only when its size and SHA-256 are the manifest's (:meth:`DraftCache.check_file`); anything else is
deleted and fetched again. A complete version is found again by its digest, so a second run fetches nothing; a
cached file whose size changed since (truncated on disk) makes the version incomplete again (its other files are
kept).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from specdec_runtime.common.draft_manifest import DraftFile, DraftManifest, sha256_file
from specdec_runtime.common.errors import DraftIntegrityError
from specdec_runtime.common.paths import default_cache_dir

COMPLETE_MARKER = ".specdec-complete"
PART_SUFFIX = ".part"


class DraftCache:
    """The delivered drafts on this device (see the module docstring). ``root``: None = the default."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir() / "delivered-drafts"

    def folder(self, manifest: DraftManifest) -> Path:
        """Where the complete version lives (whether or not it is there)."""
        return self.root / manifest.name / f"{manifest.version}-{manifest.digest[:16]}"

    def incoming(self, manifest: DraftManifest) -> Path:
        """The version's download folder (created)."""
        path = self.root / manifest.name / f".incoming-{manifest.digest[:16]}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def complete(self, manifest: DraftManifest) -> Path | None:
        """The complete version's folder when it is cached and every file has its size, else None (a version
        with a file of another size is moved back to incoming, its other files kept)."""
        folder = self.folder(manifest)
        try:
            if (folder / COMPLETE_MARKER).read_text().strip() != manifest.digest:
                return None
        except OSError:
            return None
        for f in manifest.files:
            p = folder / f.path
            if not p.is_file() or p.stat().st_size != f.size:
                (folder / COMPLETE_MARKER).unlink(missing_ok=True)
                incoming = self.root / manifest.name / f".incoming-{manifest.digest[:16]}"
                shutil.rmtree(incoming, ignore_errors=True)
                os.rename(folder, incoming)
                p = incoming / f.path
                if p.exists():
                    p.unlink()
                return None
        return folder

    def has_file(self, folder: Path, entry: DraftFile) -> bool:
        """Whether ``folder`` holds ``entry`` checked (size and SHA-256); a file that fails is deleted."""
        p = folder / entry.path
        if not p.is_file():
            return False
        try:
            self.check_file(p, entry)
        except DraftIntegrityError:
            p.unlink(missing_ok=True)
            return False
        return True

    @staticmethod
    def check_file(path: Path, entry: DraftFile) -> None:
        """Raises DraftIntegrityError when ``path`` is not ``entry`` (size, then SHA-256)."""
        size = path.stat().st_size
        if size != entry.size:
            raise DraftIntegrityError(f"draft file {entry.path}: {size} bytes, the manifest says {entry.size}")
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise DraftIntegrityError(f"draft file {entry.path}: sha256 {digest[:16]}..., the manifest says "
                                      f"{entry.sha256[:16]}...")

    def finish(self, manifest: DraftManifest) -> Path:
        """Mark the incoming folder complete (every file there and checked) and move it into place."""
        incoming, folder = self.incoming(manifest), self.folder(manifest)
        (incoming / COMPLETE_MARKER).write_text(manifest.digest + "\n")
        if folder.exists():  # a stale folder of the same digest (incomplete): replaced
            shutil.rmtree(folder)
        os.rename(incoming, folder)
        return folder
