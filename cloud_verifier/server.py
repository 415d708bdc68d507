"""gRPC server of the cloud verifier: ``specdec.v1.Verifier`` (grpc.aio) + health + reflection + /metrics.

- :class:`VerifierServicer` converts wire messages (common.wire) and calls a
  :class:`cloud_verifier.verifier.Verifier`. Errors raised as :class:`~common.errors.SpecdecError` become the
  RPC's status in one place, :class:`ErrorMappingInterceptor` (never INTERNAL for known errors).
- ``Verify`` (bidi stream, any sessions): each block is handed to the verifier as soon as it arrives, so blocks
  of different sessions on one stream are batched together; blocks of one session run one after the other;
  verdicts come back in block order. A block that fails ends the stream with its status after the verdicts
  of the blocks before it; nothing is committed for it, and blocks that arrived after it are not verified
  (they fail fast: the verifier validates a block before it joins a batch). Only an error raised inside a
  batch (e.g. the session store failing) can leave a later block of another session, already in that batch,
  committed without its verdict; a client can resynchronize with GetSession.
- Health (``grpc.health.v1``): SERVING for "" and "specdec.v1.Verifier" while up, NOT_SERVING from the start
  of a graceful shutdown. Reflection lists the services.
- Graceful shutdown (SIGTERM/SIGINT, :meth:`VerifierServer.stop`): health NOT_SERVING, new blocks on open
  streams answered UNAVAILABLE (the client reconnects elsewhere), in-flight blocks finish and are answered,
  then ``server.stop(grace)`` and ``verifier.stop(grace)``.

Entry points: ``await serve(settings)`` (``specdec serve``); :class:`VerifierServer` on a running event loop
(``specdec.embedded.EmbeddedServer`` runs one in a background thread for ``specdec generate`` and tests).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.errors import SpecdecError, VerifierUnavailableError
from common.wire import (
    MAX_MESSAGE_BYTES,
    block_from_proto,
    open_request_from_proto,
    finish_reason_to_proto,
    session_opened_to_proto,
    verdict_to_proto,
)
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from cloud_verifier.config import VerifierSettings
    from cloud_verifier.store import SessionRecord
    from cloud_verifier.verifier import Verifier

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name  # "specdec.v1.Verifier"
_METHOD_PREFIX = f"/{SERVICE_NAME}/"
STREAM_WINDOW = 64  # blocks read ahead on one Verify stream before back-pressure (HTTP/2 flow control)

SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # never share a port with another server by accident
    ("grpc.keepalive_time_ms", 60_000),  # ping idle clients every 60 s to find dead connections
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # allow client keepalive (30 s) pings
    ("grpc.http2.max_ping_strikes", 0),
]


# ------------------------------------------------------------------------------------------- errors


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (status code, message) an exception is answered with."""
    if isinstance(err, SpecdecError):
        return err.code, str(err)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"


async def _abort(context: grpc.aio.ServicerContext, err: BaseException, method: str):
    code, message = status_of(err)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=err)
    else:
        log.debug("%s -> %s: %s", method, code.name, message)
    await context.abort(code, message)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions of specdec.v1.Verifier handlers into statuses: SpecdecError → ``err.code``
    (common.errors), anything else → INTERNAL (logged with its traceback)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_METHOD_PREFIX):
            return handler
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner(request, context)
                except (SpecdecError, Exception) as err:  # noqa: B014 - explicit: all errors are mapped
                    if isinstance(err, grpc.aio.AbortError):
                        raise
                    await _abort(context, err, method)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def stream_stream(request_iterator, context):
                try:
                    async for response in inner_stream(request_iterator, context):
                        yield response
                except Exception as err:
                    if isinstance(err, grpc.aio.AbortError):
                        raise
                    await _abort(context, err, method)

            return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
        return handler


# ------------------------------------------------------------------------------------------- servicer


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
    )


class _Skipped(VerifierUnavailableError):
    """A block not verified because an earlier block of its stream failed (never sent to the client)."""


class VerifierServicer(pb_grpc.VerifierServicer):
    """specdec.v1.Verifier over a :class:`cloud_verifier.verifier.Verifier` (errors: raised, mapped by
    :class:`ErrorMappingInterceptor`)."""

    def __init__(self, verifier: "Verifier"):
        self.verifier = verifier
        self._drain = asyncio.Event()
        self._background: set[asyncio.Task] = set()  # block tasks that outlive an aborted stream

    def begin_drain(self) -> None:
        """Shutting down: open streams finish their in-flight blocks, then end with UNAVAILABLE."""
        self._drain.set()

    @property
    def draining(self) -> bool:
        return self._drain.is_set()

    def _forget_task(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: blocks whose verdict cannot be sent (stream aborted) log nothing

    async def OpenSession(self, request: pb.OpenSessionRequest, context) -> pb.OpenSessionResponse:
        if self.draining:
            raise VerifierUnavailableError("verifier is shutting down")
        prompt, sampling, stopping, fingerprint = open_request_from_proto(request)
        opened = await self.verifier.open_session(prompt, sampling, stopping, fingerprint)
        return session_opened_to_proto(opened)

    async def VerifyBlock(self, request: pb.DraftBlock, context) -> pb.Verdict:
        if self.draining:
            raise VerifierUnavailableError("verifier is shutting down")
        session_id, seq, committed_length, block = block_from_proto(request)
        verdict = await self.verifier.verify(session_id, seq, committed_length, block)
        return verdict_to_proto(verdict, seq)

    async def GetSession(self, request: pb.GetSessionRequest, context) -> pb.SessionInfo:
        return session_info_to_proto(self.verifier.get_session(request.session_id))

    async def CloseSession(self, request: pb.CloseSessionRequest, context) -> pb.CloseSessionResponse:
        return pb.CloseSessionResponse(existed=bool(self.verifier.close_session(request.session_id)))

    async def Verify(self, request_iterator, context):
        """Blocks in, verdicts out in block order (see the module docstring)."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=STREAM_WINDOW)  # Task | SpecdecError | None (= end)
        last_of_session: dict[str, asyncio.Task] = {}
        no_failure = float("inf")
        state = {"failed_at": no_failure, "count": 0}  # failed_at: stream index of the first failed block

        async def run_block(index: int, prev: asyncio.Task | None, session_id, seq, committed_length, block):
            if prev is not None and not prev.done():
                await asyncio.wait([prev])  # one block of a session at a time, in stream order
            if state["failed_at"] < index:  # an earlier block failed: the stream ends, later ones are not verified
                raise _Skipped()
            try:
                return await self.verifier.verify(session_id, seq, committed_length, block)
            except BaseException:
                # Set synchronously: the verifier validates a block before its first suspension, so a block
                # failing validation is seen by every block created after it (asyncio runs tasks FIFO).
                state["failed_at"] = min(state["failed_at"], index)
                raise

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    if self.draining:
                        await queue.put(VerifierUnavailableError("verifier is shutting down"))
                        return
                    try:
                        session_id, seq, committed_length, block = block_from_proto(msg)
                    except SpecdecError as err:
                        await queue.put(err)
                        return
                    state["count"] += 1
                    task = asyncio.create_task(run_block(
                        state["count"], last_of_session.get(session_id), session_id, seq, committed_length, block
                    ))
                    last_of_session[session_id] = task
                    self._background.add(task)
                    task.add_done_callback(self._forget_task)
                    await queue.put(task)
                await queue.put(None)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the stream broke (client gone): end the handler
                await queue.put(err)

        reader = asyncio.create_task(read())
        drain_wait: asyncio.Task | None = None
        try:
            while True:
                if queue.empty():
                    if self.draining and not reader.done():
                        raise VerifierUnavailableError("verifier is shutting down")
                    get = asyncio.ensure_future(queue.get())
                    if drain_wait is None:
                        drain_wait = asyncio.ensure_future(self._drain.wait())
                    await asyncio.wait({get, drain_wait}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        get.cancel()
                        continue  # draining: loop to answer what is queued, then end
                    item = get.result()
                else:
                    item = queue.get_nowait()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                verdict = await item
                yield verdict_to_proto(verdict, verdict.seq)
        except BaseException:
            state["failed_at"] = -1  # the stream is over: verify nothing more
            raise
        finally:
            reader.cancel()
            if drain_wait is not None:
                drain_wait.cancel()


# ------------------------------------------------------------------------------------------- server


class VerifierServer:
    """One grpc.aio server (Verifier + health + reflection) around a Verifier, on the running event loop.

    ``host``/``port``: bind address (port 0 = a free port, see :attr:`port` after :meth:`start`);
    ``grace_s``: default shutdown grace period, s; ``owns_verifier``: free the verifier's resources on stop.
    """

    def __init__(self, verifier: "Verifier", *, host: str = "0.0.0.0", port: int = 50051, grace_s: float = 10.0,
                 owns_verifier: bool = False):
        self.verifier = verifier
        self.host = host
        self.requested_port = port
        self.grace_s = grace_s
        self.owns_verifier = owns_verifier
        self.port: int | None = None
        self.server: grpc.aio.Server | None = None
        self.servicer: VerifierServicer | None = None
        self.health = health.aio.HealthServicer()
        self._stopped: asyncio.Event | None = None
        self._stopping = False

    @property
    def address(self) -> str:
        """"host:port" clients can dial (0.0.0.0 / :: become 127.0.0.1)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]", "") else self.host
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Start the verifier (batcher, reaper) and the gRPC server; returns the bound port.

        Raises:
            RuntimeError: the address cannot be bound.
        """
        self._stopped = asyncio.Event()
        self.servicer = VerifierServicer(self.verifier)
        server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()], options=SERVER_OPTIONS)
        pb_grpc.add_VerifierServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        bind = f"[{self.host}]:{self.requested_port}" if ":" in self.host else f"{self.host}:{self.requested_port}"
        try:
            port = server.add_insecure_port(bind)
        except RuntimeError as e:
            raise RuntimeError(f"cannot bind the verifier to {bind}: {e}") from e
        if not port:
            raise RuntimeError(f"cannot bind the verifier to {bind}")
        self.port = port
        await self.verifier.start()
        await server.start()
        self.server = server
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("verifier %s serving %s on %s (model %s)", self.verifier.info.verifier_id, SERVICE_NAME,
                 bind.replace(f":{self.requested_port}", f":{port}"), self.verifier.info.model_id)
        return port

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop: NOT_SERVING, drain streams, let in-flight blocks finish (``grace_s`` s), stop."""
        if self._stopping or self.server is None:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        self._stopping = True
        grace = self.grace_s if grace_s is None else grace_s
        start = time.monotonic()
        try:
            await self.health.enter_graceful_shutdown()
            self.servicer.begin_drain()
            await self.server.stop(grace)  # in-flight RPCs finish; the verifier still runs meanwhile
            await self.verifier.stop(max(0.0, grace - (time.monotonic() - start)))
            if self.owns_verifier:
                self.verifier.shutdown()
            log.info("verifier stopped in %.2f s", time.monotonic() - start)
        finally:
            self._stopped.set()


async def serve(
    settings: "VerifierSettings",
    verifier: "Verifier | None" = None,
    *,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run a verifier until SIGTERM/SIGINT (or ``stop`` is set), then shut down gracefully.

    ``verifier``: None = ``Verifier.from_settings(settings)`` (loads the target). ``ready`` is set once the
    server accepts RPCs. Starts the Prometheus /metrics endpoint on ``settings.metrics_port`` unless 0/None.
    """
    owns = verifier is None
    if verifier is None:
        from cloud_verifier.verifier import Verifier

        verifier = await asyncio.to_thread(Verifier.from_settings, settings)
    server = VerifierServer(verifier, host=settings.host, port=settings.port, grace_s=settings.grace_period_s,
                            owns_verifier=owns)
    if settings.metrics_port:  # before the gRPC server: a port conflict must not leave a half-started server
        from cloud_verifier import metrics

        try:
            metrics.serve_metrics(settings.metrics_port, addr=settings.host)
        except OSError as e:
            if owns:
                verifier.shutdown()
            raise VerifierUnavailableError(
                f"cannot serve metrics on {settings.host}:{settings.metrics_port}: {e.strerror or e} "
                "(set --metrics-port / SPECDEC_METRICS_PORT to a free port, or 0 to disable)"
            ) from None
        log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
    await server.start()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / platform
            pass
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
        log.info("shutting down (grace %.1f s)", settings.grace_period_s)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await server.stop()
