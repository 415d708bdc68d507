"""gRPC server of the cloud verifier: ``specdec.v1.Verifier`` (grpc.aio) + health + reflection + /metrics.

- :class:`~cloud_verifier.serving.servicer.VerifierServicer` converts wire messages (common.wire) and calls a
  :class:`cloud_verifier.verifier.Verifier`. Errors raised as :class:`~common.errors.SpecdecError` become the
  RPC's status in one place, :class:`ErrorMappingInterceptor` (never INTERNAL for known errors).
- ``Verify`` (bidi stream, any sessions; :mod:`cloud_verifier.serving.verify_stream`): each block is handed to the
  verifier as soon as it arrives, so blocks of different sessions on one stream are batched together; blocks of
  one session run one after the other; verdicts come back in block order. A block that fails ends the stream
  with its status after the verdicts of the blocks before it; nothing is committed for it, and blocks that
  arrived after it are not verified (they fail fast: the verifier validates a block before it joins a batch).
  Only an error raised inside a batch (e.g. the session store failing) can leave a later block of another
  session, already in that batch, committed without its verdict; a client can resynchronize with GetSession.
- Health (``grpc.health.v1``): "" and "specdec.v1.Verifier" are SERVING exactly while the replica can take a
  session: NOT_SERVING from the start until the first health check passes, while the session store cannot take
  a session (down; a Redis Cluster with a slot not served) or the batch loop is stuck (a health task checks every
  ``health_interval_s``, every :data:`READY_POLL_S` at most while NOT_SERVING, so a replica turns SERVING soon
  after it can), and from the start of a graceful shutdown on; "liveness" is NOT_SERVING only while the batch
  loop is stuck (Kubernetes liveness probe). Reflection lists the services.
- Graceful shutdown (SIGTERM/SIGINT, :meth:`VerifierServer.stop`): health NOT_SERVING at once, new blocks on
  open streams answered UNAVAILABLE (the SDK retries them on another replica), in-flight blocks finish and are
  answered, then ``server.stop(grace)`` and ``verifier.stop(grace)``, which gives the replica's sessions up in
  the store (another replica resumes each at its next block).
- A stream that ends early (the client cancelled it, or it broke): its blocks still queued are dropped (nothing
  committed), those in a forward pass end committed wholly; the sessions are free for the client's next stream.

Entry points: ``await serve(settings)`` (what ``specdec serve`` runs: the command line is the tooling's, the
runtime imports nothing of it); :class:`VerifierServer` on a running event loop
(``specdec.embedded.EmbeddedServer`` runs one in a background thread for ``specdec generate`` and tests).
"""

from __future__ import annotations

import os

# Before torch is imported (it reads it once): idle OpenMP threads sleep instead of spinning. With the default
# (active) policy each small CPU op cost ~15 ms on a loaded box. setdefault: OMP_WAIT_POLICY=ACTIVE still wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import asyncio  # noqa: E402 - after the environment default above
import logging
import signal
import time
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec_runtime.cloud_verifier.security.auth import AuthInterceptor
from specdec_runtime.cloud_verifier.serving.servicer import VerifierServicer, session_info_to_proto
from specdec_runtime.cloud_verifier.serving.verify_stream import STREAM_WINDOW
from specdec_runtime.common.errors import SpecdecError, VerifierUnavailableError
from specdec_runtime.common.keepalive import server_keepalive_options
from specdec_runtime.common.wire import MAX_MESSAGE_BYTES
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from specdec_runtime.cloud_verifier.config import VerifierSettings
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog
    from specdec_runtime.cloud_verifier.security.transport import ServerSecurity
    from specdec_runtime.cloud_verifier.verifier import Verifier

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name  # "specdec.v1.Verifier"
# Health service names: SERVICE_NAME and "" = ready to serve (readiness probes, balancers); LIVENESS_SERVICE =
# the process makes progress (liveness probes: NOT_SERVING only when the batch loop is stuck, not while Redis is
# down, which a restart would not fix).
LIVENESS_SERVICE = "liveness"
READY_POLL_S = 0.2  # the health task's longest period while NOT_SERVING (not ready yet, or no more), s
_METHOD_PREFIX = f"/{SERVICE_NAME}/"
__all__ = ["LIVENESS_SERVICE", "READY_POLL_S", "SERVER_OPTIONS", "SERVICE_NAME", "STREAM_WINDOW", "ErrorMappingInterceptor",
           "VerifierServer", "VerifierServicer", "serve", "session_info_to_proto", "status_of"]

SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # never share a port with another server by accident
    # ping idle clients every 60 s; accept the edge's keepalive pings (every 30 s, also without calls): the
    # policy and the edge's keepalive are defined together in common/keepalive.py
    *server_keepalive_options(),
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
    # e.g. RateLimitedError: ("retry-after-ms", "<ms>") with RESOURCE_EXHAUSTED
    await context.abort(code, message, trailing_metadata=tuple(getattr(err, "trailing_metadata", None) or ()))


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
        if handler.unary_stream is not None:  # Decode (cloud_verifier.serving.decode_stream)
            inner_unary_stream = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for response in inner_unary_stream(request, context):
                        yield response
                except Exception as err:
                    if isinstance(err, grpc.aio.AbortError):
                        raise
                    await _abort(context, err, method)

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        return handler


# ------------------------------------------------------------------------------------------- server


class VerifierServer:
    """One grpc.aio server (Verifier + health + reflection) around a Verifier, on the running event loop.

    ``host``/``port``: bind address (port 0 = a free port, see :attr:`port` after :meth:`start`);
    ``grace_s``: default shutdown grace period, s; ``owns_verifier``: free the verifier's resources on stop;
    ``options``: gRPC server options (default :data:`SERVER_OPTIONS`); ``health_interval_s``: period of the
    health task, s (0 = no health task); ``stuck_after_s``: a batch loop silent for this long is stuck, s;
    ``drafts``: the drafts it delivers (:class:`cloud_verifier.drafts.catalog.DraftCatalog`; None = none).

    Health (``grpc.health.v1``, services "" and "specdec.v1.Verifier") tells the truth: SERVING while the batch
    loop beats and the session store can take a session, NOT_SERVING otherwise (checked every
    ``health_interval_s``, every :data:`READY_POLL_S` at most while NOT_SERVING), until the first check has passed,
    and from the first moment of a graceful shutdown on.
    """

    def __init__(self, verifier: "Verifier", *, host: str = "127.0.0.1", port: int = 50051, grace_s: float = 10.0,
                 owns_verifier: bool = False, options: list[tuple[str, Any]] | None = None,
                 health_interval_s: float = 1.0, stuck_after_s: float = 60.0,
                 security: "ServerSecurity | None" = None, drafts: "DraftCatalog | None" = None):
        self.security = security
        self.drafts = drafts  # the drafts it hands out (cloud_verifier.drafts.catalog); None = no delivery
        self.options = list(SERVER_OPTIONS if options is None else options)
        self.health_interval_s = health_interval_s
        self.stuck_after_s = stuck_after_s
        self.not_serving_reason: str | None = "starting"  # why health says NOT_SERVING (None while SERVING)
        self._health_task: asyncio.Task | None = None
        self._live = True  # what "liveness" says
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
        self.servicer = VerifierServicer(self.verifier, self.drafts)
        interceptors: list[grpc.aio.ServerInterceptor] = [ErrorMappingInterceptor()]
        if self.security is not None and self.security.api_keys is not None:
            interceptors.insert(0, AuthInterceptor(self.security.api_keys))  # outermost: before anything else
        server = grpc.aio.server(interceptors=interceptors, options=self.options)
        pb_grpc.add_VerifierServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        bind = f"[{self.host}]:{self.requested_port}" if ":" in self.host else f"{self.host}:{self.requested_port}"
        try:
            if self.security is not None and self.security.credentials is not None:
                port = server.add_secure_port(bind, self.security.credentials)
            else:
                port = server.add_insecure_port(bind)
        except RuntimeError as e:
            raise RuntimeError(f"cannot bind the verifier to {bind}: {e}") from e
        if not port:
            raise RuntimeError(f"cannot bind the verifier to {bind}")
        self.port = port
        await self.verifier.start()
        await server.start()
        self.server = server
        self.servicer.drafts.start_checks()  # canary and watchdog decisions without a client asking
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        if self.health_interval_s and hasattr(self.verifier, "check_health"):
            # ready only once a check passed (a store still forming is not announced as ready); the first check
            # before start returns, so a caller that dials the port at once reads the truth
            await self._set_ready(self.not_serving_reason)
            await self._apply_check(first=True)
            self._health_task = asyncio.create_task(self._health_loop())
        else:  # nothing to check: ready now
            self.not_serving_reason = None
            await self._set_ready(None)
        log.info("verifier %s serving %s on %s (model %s)", self.verifier.info.verifier_id, SERVICE_NAME,
                 bind.replace(f":{self.requested_port}", f":{port}"), self.verifier.info.model_id)
        sec = self.security
        log.info("transport: %s; %s", ("mutual TLS" if sec.mutual_tls else "TLS") if sec and sec.tls else "plaintext",
                 f"API keys ({len(sec.api_keys.tenants)} tenants)" if sec and sec.api_keys else "no authentication")
        target = getattr(self.verifier, "target", None)
        if getattr(target, "device", None) is not None:  # where the forward passes run (the store is logged too)
            log.info("target on %s, %s", target.device, str(target.dtype).replace("torch.", ""))
        return port

    async def _set_ready(self, reason: str | None) -> None:
        """Readiness ("" and SERVICE_NAME): SERVING when ``reason`` is None, else NOT_SERVING."""
        status = (health_pb2.HealthCheckResponse.SERVING if reason is None
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def _health_loop(self) -> None:
        """Every ``health_interval_s`` (every :data:`READY_POLL_S` at most while NOT_SERVING): :meth:`_apply_check`.
        Ends at shutdown (which sets NOT_SERVING for good)."""
        while not self._stopping:
            await asyncio.sleep(self.health_interval_s if self.not_serving_reason is None
                                else min(self.health_interval_s, READY_POLL_S))
            if not self._stopping:
                await self._apply_check()

    async def _apply_check(self, first: bool = False) -> None:
        """One health check: NOT_SERVING while the store cannot take a session or the batch loop is stuck
        (:meth:`cloud_verifier.verifier.Verifier.check_health`, in a worker thread), SERVING once both are fine;
        "liveness" NOT_SERVING only while the loop is stuck. A change is logged."""
        try:
            stuck = self.verifier.stuck_reason(self.stuck_after_s)
            reason = stuck or await asyncio.to_thread(self.verifier.check_health, self.stuck_after_s)
        except Exception as e:  # noqa: BLE001 - a failing check is a failing replica
            stuck, reason = None, f"health check failed: {e}"
        if self._stopping:
            return
        if (stuck is None) != self._live:
            self._live = stuck is None
            await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING if self._live
                                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        if reason != self.not_serving_reason or first:
            if reason is None:
                log.info("health: SERVING" if first else "health: SERVING again")
            else:
                log.warning("health: NOT_SERVING: %s", reason)
            self.not_serving_reason = reason
            await self._set_ready(reason)

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop: NOT_SERVING, drain streams, let in-flight blocks finish (``grace_s`` s), give up the
        replica's sessions in the store (another replica resumes each at its next block), stop."""
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
            if self._health_task is not None:
                self._health_task.cancel()
            self.servicer.drafts.stop_checks()
            await self.server.stop(grace)  # in-flight RPCs finish; the verifier still runs meanwhile
            await self.verifier.stop(max(0.0, grace - (time.monotonic() - start)))
            if self.owns_verifier:
                self.verifier.shutdown()
            log.info("verifier stopped in %.2f s", time.monotonic() - start)
        finally:
            self._stopped.set()


def _draft_catalog(settings: "VerifierSettings") -> "DraftCatalog | None":
    """The drafts the settings hand out (``drafts_dir``), None for no delivery.

    Raises:
        ValueError: the drafts folder does not exist.
    """
    if not settings.drafts_dir:
        return None
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog

    drafts = DraftCatalog(settings.drafts_dir, default_name=settings.default_draft,
                          canary_min_blocks=settings.draft_canary_min_blocks,
                          canary_margin=settings.draft_canary_margin, watchdog_margin=settings.draft_watchdog_margin)
    log.info("delivering drafts from %s: %s", settings.drafts_dir,
             ", ".join(m.label for m in drafts.list()) or "none yet")
    return drafts


async def _served_as_torchrun_worker(settings: "VerifierSettings") -> bool:
    """Refuse unsupported tensor-parallel settings (one line, before anything loads); in a torchrun rank > 0,
    serve forward steps (no gRPC) until the group ends and return True.

    Raises:
        cloud_verifier.parallel.TensorParallelError: unsupported settings. RuntimeError: this rank failed.
    """
    if getattr(settings, "tensor_parallel", 1) <= 1:
        return False
    from specdec_runtime.cloud_verifier import parallel

    parallel.check_settings(settings)
    if not parallel.is_torchrun_worker(settings):
        return False
    code = await asyncio.to_thread(parallel.run_torchrun_worker, settings)
    if code:
        raise RuntimeError(f"tensor-parallel rank {os.environ.get('RANK')} failed (exit code {code})")
    return True


def _serve_metrics(settings: "VerifierSettings", owned: "Verifier | None") -> None:
    """The Prometheus /metrics endpoint on ``settings.metrics_port``; on a port it cannot bind, ``owned`` (the
    verifier serve loaded, None when the caller's) is shut down. Raises: VerifierUnavailableError (one line)."""
    from specdec_runtime.cloud_verifier import metrics

    try:
        metrics.serve_metrics(settings.metrics_port, addr=settings.host)
    except OSError as e:
        if owned is not None:
            owned.shutdown()
        raise VerifierUnavailableError(
            f"cannot serve metrics on {settings.host}:{settings.metrics_port}: {e.strerror or e} "
            "(set --metrics-port / SPECDEC_METRICS_PORT to a free port, or 0 to disable)"
        ) from None
    log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)


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

    Raises:
        cloud_verifier.security.transport.InsecureBindError: a non-loopback host without TLS and API keys, not insecure
            (checked before the target is loaded).
        ValueError: TLS files or the API-key file missing, unreadable or malformed, or the drafts folder missing
            (one line).
    """
    from specdec_runtime.cloud_verifier.security.transport import ServerSecurity

    if verifier is None and await _served_as_torchrun_worker(settings):
        return
    security = ServerSecurity.from_settings(settings)  # before loading anything: a refused start is immediate
    drafts = _draft_catalog(settings)
    owns = verifier is None
    if verifier is None:
        from specdec_runtime.cloud_verifier.verifier import Verifier

        verifier = await asyncio.to_thread(Verifier.from_settings, settings)
    ledger = getattr(verifier, "ledger", None)  # acceptance per draft version (cloud_verifier.drafts.ledger)
    if ledger is not None:
        ledger.baseline_blocks, ledger.window_blocks = settings.draft_baseline_blocks, settings.draft_window_blocks
    server = VerifierServer(verifier, host=settings.host, port=settings.port, grace_s=settings.grace_period_s,
                            owns_verifier=owns, health_interval_s=settings.health_check_interval_s,
                            stuck_after_s=settings.batch_stuck_after_s, security=security, drafts=drafts)
    if settings.metrics_port:  # before the gRPC server: a port conflict must not leave a half-started server
        _serve_metrics(settings, verifier if owns else None)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    ranks = getattr(verifier.target, "parallel", None)  # tensor parallel: a failed rank stops this replica
    if ranks is not None:
        ranks.on_failure.append(lambda reason: loop.call_soon_threadsafe(stop.set))
    try:
        await server.start()
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
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
        if ranks is not None:
            ranks.close()
    if ranks is not None and ranks.failure is not None:  # the replica is down: a non-zero exit, one line
        raise RuntimeError(f"tensor parallel: {ranks.failure}")


if __name__ == "__main__":  # the runtime has no command line of its own (docs/architecture.md, "Entry points")
    raise SystemExit("cloud_verifier.serving.server is a library module: start a verifier with `specdec serve [flags]` "
                     "(or call cloud_verifier.serving.server.serve(settings) from Python)")
