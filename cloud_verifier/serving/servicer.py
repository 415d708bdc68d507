"""The ``specdec.v1.Verifier`` servicer: wire messages (common.wire) in, calls of a
:class:`cloud_verifier.verifier.Verifier`, wire messages out.

Errors are raised as :class:`~common.errors.SpecdecError` and become the RPC's status in one place,
:class:`cloud_verifier.serving.server.ErrorMappingInterceptor`. The bidi ``Verify`` stream is
:class:`cloud_verifier.serving.verify_stream.VerifyStream`. Every RPC runs as the caller's tenant when the call was
authenticated (cloud_verifier.security.auth).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import TYPE_CHECKING

from specdec_runtime.cloud_verifier import metrics
from specdec_runtime.cloud_verifier.drafts.delivery import DraftDelivery
from specdec_runtime.cloud_verifier.security.auth import current_tenant
from specdec_runtime.cloud_verifier.serving.decode_stream import DecodeStops, DecodeStream, load_hint
from specdec_runtime.cloud_verifier.serving.verify_stream import VerifyStream
from specdec_runtime.common.errors import VerifierUnavailableError
from specdec_runtime.common.wire import (
    block_from_proto,
    extend_request_from_proto,
    finish_reason_to_proto,
    logprobs_to_proto,
    open_request_from_proto,
    session_opened_to_proto,
    verdict_to_proto,
)
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog
    from specdec_runtime.cloud_verifier.store import SessionRecord
    from specdec_runtime.cloud_verifier.verifier import Verifier


def session_info_to_proto(record: "SessionRecord") -> pb.SessionInfo:
    """The wire form of a session's store record (GetSession)."""
    return pb.SessionInfo(
        session_id=record.session_id,
        model_id=record.model_id,
        verifier_id=record.verifier_id,
        committed_length=record.committed_length,
        prompt_length=record.prompt_length,
        committed_token_ids=[int(t) for t in record.committed_token_ids],
        finished=record.finished,
        finish_reason=finish_reason_to_proto(record.finish_reason if record.finished else None),
        output_logprobs=logprobs_to_proto(record.output_logprobs),
    )


def _tenant_kw() -> dict[str, str]:
    """``{"tenant_id": <the caller's tenant>}`` when the call was authenticated (cloud_verifier.security.auth), else {}:
    without authentication every session is the "" tenant's, the Verifier's default."""
    tenant = current_tenant()
    return {"tenant_id": tenant} if tenant else {}


class VerifierServicer(pb_grpc.VerifierServicer):
    """specdec.v1.Verifier over a :class:`cloud_verifier.verifier.Verifier` (errors: raised, mapped by
    :class:`cloud_verifier.serving.server.ErrorMappingInterceptor`)."""

    def __init__(self, verifier: "Verifier", drafts: "DraftCatalog | None" = None):
        self.verifier = verifier
        # ListDrafts / ResolveDraft / FetchDraft, canaries judged from the acceptance ledger (cloud_verifier.drafts)
        self.drafts = DraftDelivery(drafts, getattr(verifier, "ledger", None))
        self._drain = asyncio.Event()
        self._background: set[asyncio.Task] = set()  # block tasks that outlive an aborted stream
        self._decode_stops = DecodeStops()  # the Decode calls running here, for StopDecode

    def begin_drain(self) -> None:
        """Shutting down: open streams finish their in-flight blocks, then end with UNAVAILABLE."""
        self._drain.set()

    @property
    def draining(self) -> bool:
        return self._drain.is_set()

    def _check_serving(self) -> None:
        """Raises: VerifierUnavailableError: shutting down."""
        if self.draining:
            raise VerifierUnavailableError("verifier is shutting down")

    def _track(self, task: asyncio.Task) -> None:
        """Keep a Verify stream's block task until it is done (it may outlive its aborted stream)."""
        self._background.add(task)
        task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: blocks whose verdict cannot be sent (stream aborted) log nothing

    async def OpenSession(self, request: pb.OpenSessionRequest, context) -> pb.OpenSessionResponse:
        self._check_serving()
        r = open_request_from_proto(request)
        opened = await self.verifier.open_session(r.prompt_token_ids, r.sampling, r.stopping,
                                                  r.tokenizer_fingerprint, num_output_tokens=r.num_output_tokens,
                                                  draft_name=r.draft_name, draft_version=r.draft_version,
                                                  features=r.features, **_tenant_kw())
        return self._opened(opened)

    async def ExtendSession(self, request: pb.ExtendSessionRequest, context) -> pb.OpenSessionResponse:
        self._check_serving()
        r = extend_request_from_proto(request)
        opened = await self.verifier.extend_session(r.session_id, r.committed_length, r.appended_token_ids,
                                                    r.sampling, r.stopping, features=r.features,
                                                    features_from=r.features_from, **_tenant_kw())
        return self._opened(opened)

    def _opened(self, opened) -> pb.OpenSessionResponse:
        """The answer to OpenSession/ExtendSession, with the load hint (cloud_verifier.serving.decode_stream)."""
        load, forward_ms = load_hint(self.verifier)
        return session_opened_to_proto(dataclasses.replace(opened, load=load, forward_ms=forward_ms))

    async def VerifyBlock(self, request: pb.DraftBlock, context) -> pb.Verdict:
        self._check_serving()
        r = block_from_proto(request)
        verdict = await self.verifier.verify(r.session_id, r.seq, r.committed_length, r.block, **_tenant_kw())
        return verdict_to_proto(verdict, r.seq)

    async def GetSession(self, request: pb.GetSessionRequest, context) -> pb.SessionInfo:
        return session_info_to_proto(self.verifier.get_session(request.session_id, **_tenant_kw()))

    async def CloseSession(self, request: pb.CloseSessionRequest, context) -> pb.CloseSessionResponse:
        # another tenant's session is answered as an unknown one (existed=False) and left alone
        existed = self.verifier.close_session(request.session_id, **_tenant_kw())
        return pb.CloseSessionResponse(existed=bool(existed))

    async def Verify(self, request_iterator, context):
        """Blocks in, verdicts out in block order (cloud_verifier.serving.verify_stream)."""
        stream = VerifyStream(self.verifier, self._drain, self._track, _tenant_kw())
        async with contextlib.aclosing(stream.verdicts(request_iterator)) as verdicts:
            async for verdict in verdicts:
                yield verdict

    async def Decode(self, request: pb.DecodeRequest, context):
        """Cloud decode: γ = 0 verify steps of one session, a verdict per token (cloud_verifier.serving.decode_stream)."""
        self._check_serving()
        metrics.DECODE_STREAMS.inc()
        stream = DecodeStream(self.verifier, self._drain, _tenant_kw(), self._decode_stops)
        async with contextlib.aclosing(stream.verdicts(request)) as verdicts:
            async for verdict in verdicts:
                metrics.DECODE_TOKENS.inc()  # a γ = 0 step commits its one token
                yield verdict

    async def StopDecode(self, request: pb.StopDecodeRequest, context) -> pb.StopDecodeResponse:
        """End a running Decode call after its step in progress (cloud_verifier.serving.decode_stream); never an error."""
        key = (_tenant_kw().get("tenant_id", ""), request.session_id, int(request.seq))
        return pb.StopDecodeResponse(stopped=self._decode_stops.stop(key))

    async def ListDrafts(self, request: pb.DraftListRequest, context) -> pb.DraftListResponse:
        """The draft versions the caller's tenant may fetch (cloud_verifier.drafts.delivery)."""
        return self.drafts.list(current_tenant())

    async def ResolveDraft(self, request: pb.DraftResolveRequest, context) -> pb.DraftManifest:
        """The draft version the caller should draft with now; NOT_FOUND when none is offered to it."""
        return await asyncio.to_thread(self.drafts.resolve, current_tenant(), request.name, request.client_id)

    async def FetchDraft(self, request: pb.FetchDraftRequest, context):
        """One file of a draft version from an offset, in chunks (cloud_verifier.drafts.delivery)."""
        async for chunk in self.drafts.fetch(request, current_tenant()):
            yield chunk
