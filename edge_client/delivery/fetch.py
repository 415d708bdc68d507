"""Getting a draft from the verifier: which one to use (ResolveDraft), and its files (FetchDraft), resumable and
checked against the manifest before anything is kept (:mod:`edge_client.delivery.cache`).

:func:`ensure_draft` is the whole step: ask which version to use; if the cache holds it complete, fetch nothing;
else fetch each missing file from where its ``.part`` stops, check size and SHA-256, and on a mismatch delete it
and fetch it again from byte 0 (up to ``attempts`` times); a stream broken mid-file (UNAVAILABLE) resumes from
the bytes written. ``only`` limits the files (the tokenizer files alone, for the cloud route).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import grpc

from specdec_runtime.common.draft_manifest import (DraftFile, DraftManifest, ManifestError, manifest_from_proto)
from specdec_runtime.common.errors import (DraftIntegrityError, DraftNotFoundError, SpecdecError,
                                           VerifierUnavailableError)
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc
from specdec_runtime.edge_client.delivery.cache import PART_SUFFIX, DraftCache
from specdec_runtime.edge_client.transport.credentials import ChannelSecurity
from specdec_runtime.edge_client.transport.errors import map_rpc_error

log = logging.getLogger(__name__)

# progress(file path, bytes of it on disk, its size): called after every chunk written
Progress = Callable[[str, int, int], None]


@dataclass
class FetchReport:
    """What one :func:`ensure_draft` did: the manifest, the folder to load, bytes downloaded, files refused
    (size or SHA-256 wrong) and fetched again, streams resumed after a break."""

    manifest: DraftManifest
    folder: Path
    bytes_downloaded: int = 0
    files_refused: int = 0
    resumes: int = 0


class DraftSource:
    """The delivery RPCs of one verifier address (TLS and API key as every other call: ``security``)."""

    def __init__(self, address: str, security: ChannelSecurity | None = None, *, timeout_s: float = 10.0,
                 client_id: str | None = None):
        self.address = address
        self.client_id = client_id or uuid.uuid4().hex  # sticky canary assignment for this client
        self.security = security or ChannelSecurity.of()
        self.timeout_s = timeout_s
        self._channel = self.security.channel(address)
        self._stub = pb_grpc.VerifierStub(self._channel)
        self._metadata = self.security.call_metadata()

    def _error(self, err: grpc.RpcError) -> SpecdecError:
        if err.code() == grpc.StatusCode.NOT_FOUND:  # a draft's NOT_FOUND, never a session's
            return DraftNotFoundError(err.details() or "draft not found")
        return map_rpc_error(err, self.address)

    def resolve(self, name: str = "") -> DraftManifest:
        """The draft version to use now (``name`` "" = the verifier's default).

        Raises:
            SpecdecError: the call's status (NOT_FOUND: none offered; UNAUTHENTICATED; UNAVAILABLE, ...);
                DraftIntegrityError: the verifier's manifest is malformed.
        """
        try:
            answer = self._stub.ResolveDraft(pb.DraftResolveRequest(name=name, client_id=self.client_id),
                                             timeout=self.timeout_s,
                                             metadata=self._metadata, wait_for_ready=True)
        except grpc.RpcError as err:
            raise self._error(err) from None
        try:
            return manifest_from_proto(answer)
        except ManifestError as e:  # what the verifier sent cannot be checked: nothing of it is kept
            raise DraftIntegrityError(str(e)) from None

    def fetch_into(self, manifest: DraftManifest, entry: DraftFile, part: Path, progress: Progress | None) -> int:
        """Append ``entry``'s bytes from ``part``'s size on; returns the bytes written.

        Raises:
            SpecdecError: the call's status (UNAVAILABLE when the stream broke: what was written stays).
            DraftIntegrityError: a chunk at an offset other than the one asked, or past the file's size.
        """
        have = part.stat().st_size if part.exists() else 0
        written = 0
        request = pb.FetchDraftRequest(name=manifest.name, version=manifest.version, path=entry.path, offset=have)
        try:
            with open(part, "ab") as out:
                for chunk in self._stub.FetchDraft(request, timeout=None, metadata=self._metadata):
                    if chunk.offset != have + written or chunk.offset + len(chunk.data) > entry.size:
                        raise DraftIntegrityError(f"draft file {entry.path}: chunk at {chunk.offset} does not "
                                                  f"continue the {have + written} bytes held")
                    out.write(chunk.data)
                    written += len(chunk.data)
                    if progress is not None:
                        progress(entry.path, have + written, entry.size)
        except grpc.RpcError as err:
            raise self._error(err) from None
        return written

    def close(self) -> None:
        self._channel.close()


def ensure_draft(source: DraftSource, cache: DraftCache, *, name: str = "", manifest: DraftManifest | None = None,
                 only: Iterable[str] | None = None, attempts: int = 3,
                 progress: Progress | None = None) -> FetchReport:
    """The draft version to use, complete in ``cache`` (see the module docstring). ``manifest``: that version
    (None = ask the verifier); ``only``: fetch just these file paths (those of the manifest) and answer the
    incoming folder that holds them.

    Raises:
        DraftIntegrityError: a file still wrong after ``attempts`` downloads.
        VerifierUnavailableError: the stream kept breaking (``attempts`` times for one file).
        SpecdecError: the verifier's answer (NOT_FOUND: no draft offered; UNAUTHENTICATED: wrong key).
    """
    manifest = manifest or source.resolve(name)
    folder = cache.complete(manifest)
    if folder is not None:
        return FetchReport(manifest, folder)
    wanted = set(only) if only is not None else None
    incoming = cache.incoming(manifest)
    report = FetchReport(manifest, incoming)
    for entry in manifest.files:
        if wanted is not None and entry.path not in wanted:
            continue
        if not cache.has_file(incoming, entry):
            _fetch_file(source, cache, manifest, entry, incoming, attempts, progress, report)
    if wanted is None:
        report.folder = cache.finish(manifest)
    return report


def _fetch_file(source: DraftSource, cache: DraftCache, manifest: DraftManifest, entry: DraftFile, folder: Path,
                attempts: int, progress: Progress | None, report: FetchReport) -> None:
    """One file into ``folder``: resumed across broken streams, refused and fetched again when it fails its
    check."""
    final = folder / entry.path
    part = final.with_name(final.name + PART_SUFFIX)
    part.parent.mkdir(parents=True, exist_ok=True)
    if part.exists() and part.stat().st_size > entry.size:
        part.unlink()
    refused = broken = 0
    while True:
        try:
            report.bytes_downloaded += source.fetch_into(manifest, entry, part, progress)
            cache.check_file(part, entry)
        except VerifierUnavailableError as e:
            broken += 1
            report.resumes += 1
            if broken >= attempts:
                raise
            log.info("draft file %s: stream broken (%s), resuming from byte %d", entry.path, e,
                     part.stat().st_size if part.exists() else 0)
            continue
        except DraftIntegrityError as e:
            part.unlink(missing_ok=True)
            refused += 1
            report.files_refused += 1
            log.warning("draft %s refused: %s (fetching it again)", manifest.label, e)
            if refused >= attempts:
                raise
            continue
        part.rename(final)
        return


__all__ = ["DraftSource", "FetchReport", "Progress", "ensure_draft"]
