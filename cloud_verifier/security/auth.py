"""API-key authentication of the verifier: a key file, and a grpc.aio interceptor that checks every call.

**Keys.** A client sends ``authorization: Bearer <key>`` metadata on every call (the SDK does it for
``api_key=``; on a TLS channel through gRPC call credentials). The verifier never stores keys, only their
SHA-256 hashes, in a text file (``SPECDEC_API_KEYS_FILE``)::

    # tenant_id  sha256(key) in hex
    acme    3b0c...e1
    acme    9f2a...07     # a second key of the same tenant (rotation)
    globex  51d4...aa

One ``tenant_id sha256_hex`` pair per line; blank lines and ``#`` comments are ignored. ``specdec keys create
--tenant NAME`` makes a key (``sk-specdec-`` + 32 random bytes, URL-safe base64), prints it once and appends its
hash. A presented key is hashed and compared with every stored hash with :func:`hmac.compare_digest` (no early
exit: the time does not depend on which hash, if any, matches).

**Reload.** The file is re-read when it changes (its mtime, size or inode), checked at most once per
``check_interval_s`` (default 1 s): the cost per call is one SHA-256, one comparison per stored key and, at most
once per interval, one ``stat``. A file that turns malformed keeps the last good keys (logged); a file that
disappears revokes every key (fail closed).

**Interceptor.** :class:`AuthInterceptor` checks every call except the gRPC health service (probes and load
balancers need it without credentials). Server reflection is authenticated too (it lists the services and
messages; ``grpcurl -H 'authorization: Bearer KEY'``). A missing, malformed or unknown key gets
UNAUTHENTICATED with one generic message, :data:`GENERIC_MESSAGE`, whatever was wrong; the request is not even
deserialized. An authenticated call runs with its tenant in :func:`current_tenant` (a context variable).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Iterable

import grpc
from prometheus_client import Counter

log = logging.getLogger(__name__)

API_KEY_PREFIX = "sk-specdec-"
GENERIC_MESSAGE = "missing or invalid API key"
MAX_KEY_CHARS = 256  # longer "keys" are refused before hashing
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HASH_RE = re.compile(r"^[0-9a-fA-F]{64}$")

# health stays open (probes, balancers); everything else, reflection included, needs a key
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})

AUTH_FAILURES = Counter("specdec_auth_failures", "Calls refused with UNAUTHENTICATED (missing or invalid API key)")

_TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("specdec_tenant", default="")


def current_tenant() -> str:
    """The tenant of the call being served ("" when authentication is off)."""
    return _TENANT.get()


# ---------------------------------------------------------------------------------------------- keys


def hash_api_key(key: str) -> str:
    """SHA-256 of the key's UTF-8 bytes, lowercase hex (what the key file stores)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_api_key() -> str:
    """A fresh random key: ``sk-specdec-`` + ``secrets.token_urlsafe(32)`` (256 random bits)."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def check_tenant_id(tenant: str) -> str:
    """``tenant`` if it is a valid tenant id (1–64 of ``A-Z a-z 0-9 . _ -``, starting alphanumeric).

    Raises:
        ValueError: not a valid tenant id.
    """
    if not TENANT_RE.match(tenant or ""):
        raise ValueError(f"invalid tenant id {tenant!r}: 1-64 characters of A-Z a-z 0-9 . _ -, starting with a "
                         "letter or digit")
    return tenant


def parse_key_file(text: str, source: str = "API keys file") -> list[tuple[str, str]]:
    """``(tenant_id, sha256_hex)`` pairs of a key file's text (comments and blank lines skipped).

    Raises:
        ValueError: a malformed line (its number is in the message; the line itself is not, it may hold a secret).
    """
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not TENANT_RE.match(parts[0]) or not _HASH_RE.match(parts[1]):
            raise ValueError(f"{source}, line {number}: expected 'tenant_id sha256_hex' (64 hex digits)")
        entries.append((parts[0], parts[1].lower()))
    return entries


def append_api_key(path: str | os.PathLike, tenant: str) -> str:
    """Make a new key for ``tenant``, append its hash to the key file at ``path`` (created with mode 0600, its
    directory too) and return the key — the only time it exists in clear.

    Raises:
        ValueError: invalid tenant id, or the existing file is malformed (nothing is written then).
        OSError: the file cannot be written.
    """
    check_tenant_id(tenant)
    path = Path(path)
    if path.exists():
        parse_key_file(path.read_text(), str(path))  # never append to a file the verifier would refuse
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    key = new_api_key()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        if f.tell() == 0:
            f.write("# specdec API keys: 'tenant_id sha256(key)' per line (specdec keys create)\n")
        f.write(f"{tenant} {hash_api_key(key)}\n")
    return key


class ApiKeyStore:
    """The key file of a verifier, reloaded when it changes.

    Args:
        path: the key file (``tenant_id sha256_hex`` lines).
        check_interval_s: the file is stat-ed at most once per this many seconds (bounds the cost per call), s.

    Raises:
        ValueError: the file is missing, unreadable or malformed at construction (one line).
    """

    def __init__(self, path: str | os.PathLike, check_interval_s: float = 1.0):
        self.path = Path(path)
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._entries: list[tuple[str, bytes]] = []  # (tenant, sha256 digest)
        self._signature: tuple | None = None
        self._next_check = 0.0
        try:
            self._load(self._stat())
        except OSError as e:
            raise ValueError(f"cannot read the API keys file {self.path}: {e.strerror or e}") from None
        if not self._entries:
            log.warning("API keys file %s holds no keys: every call will be refused", self.path)

    @property
    def tenants(self) -> list[str]:
        """Tenants with at least one key, sorted."""
        return sorted({t for t, _ in self._entries})

    def __len__(self) -> int:
        return len(self._entries)

    def _stat(self) -> tuple:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load(self, signature: tuple) -> None:
        entries = parse_key_file(self.path.read_text(), str(self.path))
        self._entries = [(tenant, bytes.fromhex(h)) for tenant, h in entries]
        self._signature = signature

    def maybe_reload(self, now: float | None = None) -> None:
        """Re-read the file if it changed since the last load; at most one ``stat`` per ``check_interval_s``.
        ``now``: ``time.monotonic()`` (default: the clock), s."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return
        with self._lock:
            if now < self._next_check:
                return
            self._next_check = now + self.check_interval_s
            try:
                signature = self._stat()
            except OSError:
                if self._entries:
                    log.warning("API keys file %s is gone: every key is revoked", self.path)
                self._entries, self._signature = [], None
                return
            if signature == self._signature:
                return
            try:
                self._load(signature)
                log.info("API keys reloaded from %s: %d keys, %d tenants", self.path, len(self._entries),
                         len(self.tenants))
            except (OSError, ValueError) as e:
                self._signature = signature  # do not retry the same bad file on every check
                log.warning("API keys file %s not reloaded (keeping the %d previous keys): %s", self.path,
                            len(self._entries), e)

    def tenant_for(self, key: str | None) -> str | None:
        """The tenant owning ``key``, or None (unknown, empty or over-long key). Constant time in which stored
        hash matches: every stored hash is compared."""
        self.maybe_reload()
        if not key or len(key) > MAX_KEY_CHARS:
            return None
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found = None
        for tenant, stored in self._entries:  # no early exit
            if hmac.compare_digest(digest, stored) and found is None:
                found = tenant
        return found

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The tenant of a call's ``authorization: Bearer <key>`` metadata, or None (missing or invalid)."""
        return self.tenant_for(bearer_token(metadata))


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The key of the first ``authorization`` metadata entry of the form ``Bearer <key>`` (scheme case-
    insensitive), or None."""
    for item in metadata or ():
        key, value = item[0], item[1]
        if key != "authorization":
            continue
        if isinstance(value, bytes):
            try:
                value = value.decode("ascii")
            except UnicodeDecodeError:
                return None
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        return token.strip() or None
    return None


# ---------------------------------------------------------------------------------------------- interceptor


async def _deny_unary(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, GENERIC_MESSAGE)


async def _deny_stream(request_or_iterator, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, GENERIC_MESSAGE)
    yield  # pragma: no cover - makes this an async generator


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED without reading the request
    (no deserializer: the bytes are never parsed)."""
    ser = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_deny_unary, response_serializer=ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_deny_stream, response_serializer=ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_deny_unary, response_serializer=ser)
    return grpc.stream_stream_rpc_method_handler(_deny_stream, response_serializer=ser)


def _with_tenant(handler: grpc.RpcMethodHandler, tenant: str) -> grpc.RpcMethodHandler:
    """``handler`` run with :func:`current_tenant` = ``tenant`` (set in the call's own task)."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    def returning(inner):  # unary response: a coroutine
        async def call(request_or_iterator, context):
            _TENANT.set(tenant)
            return await inner(request_or_iterator, context)
        return call

    def streaming(inner):  # streamed response: an async generator
        async def call(request_or_iterator, context):
            _TENANT.set(tenant)
            async for response in inner(request_or_iterator, context):
                yield response
        return call

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(returning(handler.unary_unary), **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(returning(handler.stream_unary), **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kw)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the API key of every call but ``open_methods`` (default: the health service).

    Unauthenticated calls get UNAUTHENTICATED, :data:`GENERIC_MESSAGE`; authenticated ones run with their tenant
    in :func:`current_tenant`. Put it first in the server's interceptor list (outermost).
    """

    def __init__(self, keys: ApiKeyStore, open_methods: Iterable[str] = OPEN_METHODS):
        self.keys = keys
        self.open_methods = frozenset(open_methods)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method in self.open_methods:
            return await continuation(handler_call_details)
        tenant = self.keys.authenticate(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: UNIMPLEMENTED, as without authentication
            return None
        if tenant is None:
            AUTH_FAILURES.inc()
            log.debug("refused %s: %s", method, GENERIC_MESSAGE)
            return _denied(handler)
        return _with_tenant(handler, tenant)
