"""Which Redis the session store talks to, and how it gets there again after a failover.

``SPECDEC_REDIS_URL`` forms (:func:`parse_redis_url`):

- ``redis://[user:pass@]host:port[/db]``, ``rediss://`` (TLS), ``unix://``: one Redis (standalone), through
  redis-py's ``Redis.from_url`` (its query options work).
- ``redis+sentinel://[user:pass@]h1:p1,h2:p2/service_name[/db]`` and ``rediss+sentinel://`` (TLS to the
  sentinels and to the master): the master of ``service_name`` as the sentinels know it, through
  ``Sentinel(...).master_for(...)``. The URL's credentials are the master's (the data nodes'); the sentinels'
  own are settings (``redis_sentinel_username`` / ``redis_sentinel_password``). Port default 26379.
- ``redis+cluster://[user:pass@]h1:p1,h2:p2`` and ``rediss+cluster://``: a Redis Cluster (``RedisCluster``),
  any of its nodes as seeds. Port default 6379; a cluster has no databases (no ``/db``).

:class:`StoreCaller` runs every store command: latency per command (``specdec_store_command_seconds``), and for
Sentinel and Cluster a bounded retry with backoff on a lost connection, a READONLY answer (a demoted master)
or a cluster still electing, which finds the new master; ``specdec_store_failovers_total`` counts the calls
that ended on another master than they started with. Every retried write is idempotent (the compare-and-append
fences on the committed length and answers the same commit again as the first; create answers its own record
again). A standalone Redis has no other master to find: its errors are answered at once (redis-py's own
reconnect aside).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import unquote, urlsplit

from specdec_runtime.cloud_verifier import metrics
from specdec_runtime.common.errors import VerifierUnavailableError

STANDALONE, SENTINEL, CLUSTER = "standalone", "sentinel", "cluster"
_SCHEMES = {"redis": (STANDALONE, False), "rediss": (STANDALONE, True), "unix": (STANDALONE, False),
            "redis+sentinel": (SENTINEL, False), "rediss+sentinel": (SENTINEL, True),
            "redis+cluster": (CLUSTER, False), "rediss+cluster": (CLUSTER, True)}
_DEFAULT_PORT = {SENTINEL: 26379, CLUSTER: 6379}


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``SPECDEC_REDIS_URL``: ``kind`` standalone / sentinel / cluster; ``hosts`` (host, port) seeds
    (sentinels, cluster nodes; empty for standalone, which keeps ``url`` for ``from_url``)."""

    kind: str
    url: str
    tls: bool = False
    hosts: tuple[tuple[str, int], ...] = ()
    service_name: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None

    def redacted(self) -> str:
        """The URL with its password replaced by ``***`` (for logs and error messages)."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = parts.username or ""
        return parts._replace(netloc=f"{user}:***@{netloc}").geturl()

    def describe(self) -> str:
        """One line for the log: the kind and the redacted URL."""
        return f"Redis {self.kind} at {self.redacted()}"


def _bad(url: str, why: str) -> ValueError:
    safe = RedisTarget(STANDALONE, url).redacted() if "@" in url else url
    return ValueError(f"bad SPECDEC_REDIS_URL {safe!r}: {why}")


def _hosts(url: str, netloc: str, default_port: int) -> tuple[tuple[str, int], ...]:
    hostlist = netloc.rsplit("@", 1)[-1]
    if not hostlist:
        raise _bad(url, "no host (expected h1:p1,h2:p2)")
    out = []
    for item in (i.strip() for i in hostlist.split(",")):
        if item.startswith("["):  # [ipv6]:port
            host, _, port = item[1:].partition("]")
            port = port.removeprefix(":") or str(default_port)
        else:
            host, sep, port = item.rpartition(":")
            if not sep:
                host, port = item, str(default_port)
        if not host:
            raise _bad(url, f"empty host in {item!r}")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise _bad(url, f"port {port!r} of {host!r} is not a number in 1..65535")
        out.append((host, int(port)))
    return tuple(out)


def parse_redis_url(url: str) -> RedisTarget:
    """Parse a ``SPECDEC_REDIS_URL`` (forms in the module docstring).

    Raises:
        ValueError: one line naming what is wrong (scheme, host list, port, service name, db); the password is
            never in the message.
    """
    scheme, sep, _rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise _bad(url, f"scheme {scheme!r} is not one of {', '.join(sorted(_SCHEMES))}")
    kind, tls = _SCHEMES[scheme.lower()]
    if kind == STANDALONE:
        return RedisTarget(kind, url, tls=tls)
    parts = urlsplit(url)
    creds = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    user, _, password = creds.partition(":")
    hosts = _hosts(url, parts.netloc, _DEFAULT_PORT[kind])
    if parts.query or parts.fragment:
        raise _bad(url, "query options are not supported here: use the SPECDEC_REDIS_* settings")
    path = [p for p in parts.path.split("/") if p]
    service, db = None, 0
    if kind == SENTINEL:
        if not path:
            raise _bad(url, "no service name (expected redis+sentinel://h1:p1,h2:p2/service_name[/db])")
        service, path = unquote(path[0]), path[1:]
    if len(path) > 1 or (path and not path[0].isdigit()):
        raise _bad(url, f"database {'/'.join(path)!r} is not a number")
    db = int(path[0]) if path else 0
    if kind == CLUSTER and db != 0:
        raise _bad(url, "a Redis Cluster has only database 0")
    return RedisTarget(kind, url, tls=tls, hosts=hosts, service_name=service, db=db,
                       username=unquote(user) or None, password=unquote(password) if creds and ":" in creds else None)


def connect(target: RedisTarget, socket_timeout_s: float, *, sentinel_username: str | None = None,
            sentinel_password: str | None = None, tls_ca_file: str | None = None):
    """A redis-py client for ``target`` (``Redis``, a Sentinel ``master_for`` client or ``RedisCluster``),
    bytes in and out. HA clients have redis-py's own retry off: :class:`StoreCaller` retries with a budget."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    common: dict[str, Any] = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
                                  decode_responses=False)
    if target.kind == STANDALONE:
        return redis.Redis.from_url(target.url, health_check_interval=30, **common)
    tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": tls_ca_file} if target.tls else {}
    auth = {"username": target.username, "password": target.password}
    if target.kind == SENTINEL:
        from redis.sentinel import Sentinel

        sentinel_kwargs = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
                               username=sentinel_username, password=sentinel_password, **tls)
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs, **common, **auth, **tls)
        return sentinel.master_for(target.service_name, db=target.db, retry=Retry(NoBackoff(), 0),
                                   health_check_interval=30)
    from redis.cluster import ClusterNode, RedisCluster

    # retry off here too: redis-py >= 8 retries a cluster command 10 times with backoff by default, so a ping
    # during a fail-over would block until the promotion instead of answering "not serving"
    return LazyCluster(lambda: RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.hosts],
                                            retry=Retry(NoBackoff(), 0), **common, **auth, **tls))


class LazyCluster:
    """A ``RedisCluster`` built on first use, and built again on the next use while building fails.

    ``RedisCluster(...)`` reads the slot map as it is constructed and raises ``RedisClusterException`` while
    the cluster is still forming (nodes up, ``redis-cli --cluster create`` not yet run: "All slots are not
    covered") or no node answers. Pods start together, so that is the usual order: the server must start,
    say NOT_SERVING and find the cluster once it is formed, as it does for a standalone or Sentinel store
    that is down at start. Building here answers ``ClusterDownError`` instead (a retryable error for
    :class:`StoreCaller`, "not answering" for the health check). ``factory``: builds the client (no
    arguments)."""

    PRIMARIES, REPLICAS, ALL_NODES, RANDOM = "primaries", "replicas", "all", "random"

    def __init__(self, factory: Callable[[], Any]):
        self._factory, self._client = factory, None
        self._lock = threading.Lock()

    def built(self):
        """The ``RedisCluster``, built now if not yet.

        Raises:
            redis.exceptions.ClusterDownError: the slot map cannot be read yet (its reason in the message).
        """
        if self._client is None:
            from redis.exceptions import ClusterDownError, RedisClusterException

            with self._lock:
                if self._client is None:
                    try:
                        self._client = self._factory()
                    except RedisClusterException as e:
                        raise ClusterDownError(f"cluster not ready: {' '.join(str(e).split())[:200]}") from e
        return self._client

    def register_script(self, script: str):
        """A ``Script`` bound to this client: it builds the cluster client when first run, not now."""
        from redis.commands.core import Script

        return Script(self, script.encode() if isinstance(script, str) else script)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __getattr__(self, name: str):
        return getattr(self.built(), name)


CLUSTER_HASH_SLOTS = 16384


def cluster_serves_every_slot(client) -> bool:
    """True when a Redis Cluster can take any key: every master ``client`` (a ``RedisCluster`` or
    :class:`LazyCluster`) knows answers ``CLUSTER INFO`` with ``cluster_state:ok`` and all 16384 slots assigned.

    A PING is no such test: a node answers it as soon as it runs, and while ``redis-cli --cluster create`` runs,
    each master has its slots (ADDSLOTS) before the masters know each other, so a client reading the slot map
    from every node at once sees all of them covered while each node still says ``cluster_state:fail`` and
    refuses every key (CLUSTERDOWN) for seconds more.

    Raises:
        redis.exceptions.RedisError: a master did not answer (or the slot map cannot be read yet).
    """
    infos = client.cluster_info(target_nodes=client.PRIMARIES)
    if isinstance(infos, dict) and "cluster_state" in infos:  # one master: its answer, not a dict by node
        infos = {"": infos}
    if not infos:
        return False
    return all(str(info.get("cluster_state")) == "ok"
               and int(info.get("cluster_slots_assigned", 0)) == CLUSTER_HASH_SLOTS for info in infos.values())


def _retryable() -> tuple[type[BaseException], ...]:
    import redis.exceptions as rex

    return (rex.ConnectionError, rex.TimeoutError, rex.ReadOnlyError, rex.ClusterDownError, rex.TryAgainError,
            rex.MasterDownError)


class StoreCaller:
    """Runs store commands against ``client``: latency histogram by command, errors as
    :class:`VerifierUnavailableError`, and for Sentinel/Cluster targets a retry with exponential backoff
    (``backoff_s`` doubling up to 1 s, with jitter) for at most ``retry_budget_s`` seconds in all."""

    def __init__(self, client, target: RedisTarget, retry_budget_s: float, backoff_s: float = 0.05):
        import redis.exceptions as rex

        self.client, self.target = client, target
        self.retry_budget_s = retry_budget_s if target.kind != STANDALONE else 0.0
        self.backoff_s = backoff_s
        self._unavailable = (rex.ConnectionError, rex.TimeoutError, *_retryable())

    def master_of(self, key: str | None) -> str | None:
        """Where the write for ``key`` goes, from the client's local view (no round trip): the Sentinel pool's
        master address, the cluster node serving the key's slot; None for standalone."""
        try:
            if self.target.kind == SENTINEL:
                addr = self.client.connection_pool.master_address
                return None if addr is None else f"{addr[0]}:{addr[1]}"
            if self.target.kind == CLUSTER and key is not None:
                return self.client.get_node_from_key(key).name
        except Exception:  # noqa: BLE001 - a view being rebuilt: unknown
            return None
        return None

    def __call__(self, command: str, fn: Callable, *args, key: str | None = None, **kwargs):
        """``fn(*args, **kwargs)``, timed as ``command``; ``key``: a key the command touches (which master).

        Raises:
            VerifierUnavailableError: the store did not answer within the retry budget (gRPC UNAVAILABLE).
        """
        start = time.monotonic()
        deadline = start + self.retry_budget_s
        delay, first = self.backoff_s, self.master_of(key)
        while True:
            try:
                result = fn(*args, **kwargs)
            except self._unavailable as e:
                if time.monotonic() + delay > deadline:
                    metrics.STORE_ERRORS.labels(command=command).inc()
                    raise VerifierUnavailableError(
                        f"session store unreachable ({self.target.describe()}): {type(e).__name__}: {e}") from e
                time.sleep(delay * (0.5 + random.random() / 2))
                delay = min(1.0, delay * 2)
                continue
            metrics.STORE_LATENCY.labels(command=command).observe(time.monotonic() - start)
            if first is not None and self.master_of(key) not in (None, first):
                metrics.STORE_FAILOVERS.inc()  # the write went to another master than before the call
            return result
