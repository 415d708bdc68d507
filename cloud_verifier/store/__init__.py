"""Session metadata store: which replica holds a session, its committed tokens, sampling params and seed.

The target KV cache itself lives in verifier memory; the store holds what is needed to route a session back
to its replica, rebuild its KV cache anywhere by prefill, clean up abandoned sessions and count load per
replica (docs/architecture.md, "Sessions and Redis").

Two implementations with the same semantics:

- :class:`~cloud_verifier.store.memory.MemorySessionStore`: in-process (one replica, tests, ``specdec generate``
  without a server).
- :class:`~cloud_verifier.store.redis.RedisSessionStore`: Redis, shared by all replicas: standalone, under
  Sentinel or as a Cluster (key layout: ``cloud_verifier/store/redis.py``; URL forms and failover:
  ``redis_connect.py``; Lua scripts: ``redis_lua.py``; choosing one: docs/session-store.md). Every key has a
  TTL (``ttl_s``), refreshed by activity (create, append_committed, touch). Writes are atomic Lua scripts; a
  commit is a compare-and-APPEND on the tokens string (STRLEN must equal 4 × expected length).

Expiry: a session not touched for ``ttl_s`` seconds disappears (Redis TTL / lazy check in memory);
``get`` then answers None and writes raise :class:`~common.errors.SessionNotFoundError`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from specdec_runtime.cloud_verifier.store.base import (  # noqa: F401  (the contract, named from here too)
    SessionRecord,
    SessionStore,
    check_tokens,
    copy_record,
    extend_conflict,
    finished_error,
    generating_error,
    length_mismatch,
    not_found,
    not_owner,
)
from specdec_runtime.cloud_verifier.store.memory import MemorySessionStore
from specdec_runtime.cloud_verifier.store.redis import RedisSessionStore

if TYPE_CHECKING:
    from specdec_runtime.cloud_verifier.config import VerifierSettings

log = logging.getLogger(__name__)

__all__ = ["SessionRecord", "SessionStore", "MemorySessionStore", "RedisSessionStore", "make_store"]


def make_store(settings: "VerifierSettings") -> SessionStore:
    """The store the settings ask for: Redis when ``redis_url`` is set (standalone, Sentinel or Cluster, from
    the URL's scheme), else in-process. Logs which one (password redacted).

    Raises:
        ValueError: a bad ``redis_url`` (one line naming what is wrong) or prefix.
    """
    if not settings.redis_url:
        log.info("session store: in-process (one replica)")
        return MemorySessionStore(ttl_s=settings.session_ttl_s)
    secret = settings.redis_sentinel_password
    store = RedisSessionStore(
        settings.redis_url, prefix=settings.redis_prefix, ttl_s=settings.session_ttl_s,
        socket_timeout_s=settings.redis_socket_timeout_s, retry_budget_s=settings.redis_failover_retry_s,
        wait_replicas=settings.redis_wait_replicas, wait_timeout_ms=settings.redis_wait_timeout_ms,
        sentinel_username=settings.redis_sentinel_username,
        sentinel_password=secret.get_secret_value() if secret is not None else None,
        tls_ca_file=settings.redis_tls_ca_file,
    )
    log.info("session store: %s", store.describe())
    return store
