"""The draft-delivery RPCs of ``specdec.v1.Verifier``: ListDrafts, ResolveDraft, FetchDraft.

They run behind the same interceptors as every other call (TLS, API keys: :mod:`cloud_verifier.security.auth`;
errors → status codes: :class:`cloud_verifier.serving.server.ErrorMappingInterceptor`), as the caller's tenant: a
draft restricted to other tenants is NOT_FOUND. FetchDraft streams one file of a version from an offset in
:data:`CHUNK_BYTES` pieces (resumable: a client that lost the stream asks again from the bytes it has); the file
is read in a worker thread so the event loop (and the batcher on it) never waits on the disk.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
from prometheus_client import Counter

from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog
from specdec_runtime.common.draft_manifest import manifest_to_proto
from specdec_runtime.common.errors import DraftNotFoundError, SpecdecError
from specdec_runtime.common.v1 import verifier_pb2 as pb

MIN_CHECK_INTERVAL_S = 0.2  # the background checks' shortest period, s
CHUNK_BYTES = 256 * 1024  # one FetchDraftChunk's data, bytes (well under the 32 MiB message limit)

DRAFT_FETCHES = Counter("specdec_draft_fetches", "FetchDraft calls started", ["draft_version"])
DRAFT_BYTES_SENT = Counter("specdec_draft_bytes_sent", "Draft file bytes streamed by FetchDraft", ["draft_version"])


class DraftOutOfRangeError(SpecdecError):
    """A FetchDraft offset past the end of the file: OUT_OF_RANGE."""

    code = grpc.StatusCode.OUT_OF_RANGE


class DraftDelivery:
    """The delivery RPCs over a :class:`DraftCatalog` (None: no delivery configured, every call NOT_FOUND);
    with ``ledger`` (the verifier's :class:`~cloud_verifier.drafts.ledger.AcceptanceLedger`) its canaries are
    judged as clients resolve (:class:`~cloud_verifier.drafts.canary.CanaryJudge`), and so is every version's
    acceptance against its baseline (:class:`~cloud_verifier.drafts.watchdog.Watchdog`), in the background
    (:meth:`start_checks`) and as clients resolve."""

    def __init__(self, catalog: DraftCatalog | None, ledger=None):
        self.catalog = catalog
        self.judge = self.watchdog = None
        self._task: asyncio.Task | None = None
        # the background checks' period, s (the folder's rescan interval; at least MIN_CHECK_INTERVAL_S)
        self.check_interval_s = max(MIN_CHECK_INTERVAL_S, catalog.rescan_interval_s if catalog is not None else 0.0)
        if catalog is not None and ledger is not None:
            from specdec_runtime.cloud_verifier.drafts.canary import CanaryAssignment, CanaryJudge
            from specdec_runtime.cloud_verifier.drafts.watchdog import Watchdog

            catalog.assign_canary = CanaryAssignment(ledger.redis, ledger.prefix)  # fair, shared by replicas
            self.judge = CanaryJudge(catalog, ledger, min_blocks=catalog.canary_min_blocks,
                                     margin=catalog.canary_margin, check_interval_s=catalog.rescan_interval_s)
            self.watchdog = Watchdog(catalog, ledger, margin=catalog.watchdog_margin,
                                     check_interval_s=catalog.rescan_interval_s)

    def check_now(self) -> list[tuple[str, str]]:
        """The canary judge's and the watchdog's checks that are due (blocking: reads the shared records; call it
        from a worker thread); returns their decisions. Never raises."""
        if self.judge is None:
            return []
        return self.judge.maybe_check() + self.watchdog.maybe_check()

    async def run_checks(self) -> None:
        """Check in the background until cancelled, every :attr:`check_interval_s`: a canary is decided and a
        version quarantined although no client asks for a draft. Every replica runs it; they read the same
        shared records and folder, so they take the same decisions (the first to write one counts it)."""
        while True:
            await asyncio.sleep(self.check_interval_s)
            await asyncio.to_thread(self.check_now)

    def start_checks(self) -> None:
        """Start :meth:`run_checks` on the running event loop (nothing to check without delivery and a ledger)."""
        if self.judge is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run_checks())

    def stop_checks(self) -> None:
        """Cancel the background checks."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _catalog(self) -> DraftCatalog:
        if self.catalog is None:
            raise DraftNotFoundError("this verifier delivers no drafts (SPECDEC_DRAFTS_DIR is not set)")
        return self.catalog

    def list(self, tenant: str) -> pb.DraftListResponse:
        """Every version ``tenant`` may fetch (an empty list without delivery)."""
        manifests = self.catalog.list(tenant) if self.catalog is not None else []
        return pb.DraftListResponse(drafts=[manifest_to_proto(m) for m in manifests])

    def resolve(self, tenant: str, name: str, client_id: str = "") -> pb.DraftManifest:
        """The version ``tenant`` should draft with now (a canary's for the clients it covers), after judging the
        canaries due (blocking: reads the shared records; call it from a worker thread).

        Raises:
            DraftNotFoundError: none offered.
        """
        catalog = self._catalog()
        self.check_now()  # flushes this replica's counts first
        return manifest_to_proto(catalog.resolve(tenant, name, client_id))

    async def fetch(self, request: pb.FetchDraftRequest, tenant: str) -> AsyncIterator[pb.FetchDraftChunk]:
        """One file of a version from ``request.offset``, in :data:`CHUNK_BYTES` pieces; an offset equal to the
        size streams nothing.

        Raises:
            DraftNotFoundError: unknown version or path, or not ``tenant``'s. DraftOutOfRangeError: offset past the
            end.
        """
        version = self._catalog().version(request.name, request.version, tenant)
        entry = version.manifest.file(request.path)
        if entry is None:
            raise DraftNotFoundError(f"draft {version.manifest.label} has no file {request.path!r}")
        if request.offset > entry.size:
            raise DraftOutOfRangeError(f"offset {request.offset} is past the end of {request.path} ({entry.size} "
                                       "bytes)")
        label = version.manifest.label
        DRAFT_FETCHES.labels(label).inc()
        offset = int(request.offset)
        with open(version.folder / entry.path, "rb") as f:
            f.seek(offset)
            while offset < entry.size:
                data = await asyncio.to_thread(f.read, min(CHUNK_BYTES, entry.size - offset))
                if not data:  # the file shrank under us: the client's size check refuses what it got
                    break
                yield pb.FetchDraftChunk(offset=offset, data=data, file_size=entry.size)
                DRAFT_BYTES_SENT.labels(label).inc(len(data))
                offset += len(data)
