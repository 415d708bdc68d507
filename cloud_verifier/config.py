"""Settings of the cloud verifier, read from the environment (prefix ``SPECDEC_``, e.g. ``SPECDEC_PORT``).

Every field can also be given as a keyword (``VerifierSettings(port=0)``); the environment fills the rest.
See ``deploy/verifier.env.example`` for an annotated example.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from specdec_runtime.common.types import MAX_NUM_SPECULATIVE_TOKENS


log = logging.getLogger(__name__)

# the KV page size's environment variable before "block" came to mean only a draft block; read for one release
DEPRECATED_KV_PAGE_SIZE_ENV = "SPECDEC_KV_BLOCK_SIZE"


def _default_verifier_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class VerifierSettings(BaseSettings):
    """Configuration of one verifier replica (``specdec serve``)."""

    # populate_by_name: a field with an alias (kv_page_size) is still given by its name as a keyword
    model_config = SettingsConfigDict(env_prefix="SPECDEC_", extra="ignore", validate_default=True,
                                      populate_by_name=True)

    host: str = "127.0.0.1"
    """Interface the gRPC server (and /metrics) binds to. Loopback by default; any other address needs TLS and
    API keys, or ``insecure`` (docs/security.md)."""

    insecure: bool = False
    """Allow a non-loopback ``host`` without TLS and API keys (the network in front is trusted)."""

    tls_cert_file: str | None = None
    """PEM certificate chain of the gRPC port; with ``tls_key_file`` the port is TLS-only. None = plaintext."""

    tls_key_file: str | None = None
    """PEM private key of ``tls_cert_file``."""

    tls_client_ca_file: str | None = None
    """PEM CA bundle: clients must present a certificate it signed (mutual TLS). None = no client certificates."""

    api_keys_file: str | None = None
    """API-key file (``tenant_id sha256_hex`` lines, ``specdec keys create``): every call but health needs
    ``authorization: Bearer <key>``; reloaded when it changes. None = no authentication (one tenant, "")."""

    tenant_max_sessions: int | None = Field(None, ge=1)
    """Sessions one tenant may hold on this replica (RESOURCE_EXHAUSTED past it); None = no per-tenant cap."""

    tenant_tokens_per_s: float | None = Field(None, gt=0)
    """Verified tokens per second per tenant (a block costs its draft tokens + 1), tokens/s; None = no limit."""

    tenant_tokens_burst: float | None = Field(None, gt=0)
    """Token-bucket capacity of ``tenant_tokens_per_s``, tokens; None = max(2 × rate, largest block + 1)."""

    drafts_dir: str | None = None
    """Folder of the drafts this verifier hands out to edges (ListDrafts / ResolveDraft / FetchDraft: a folder per
    draft version with its manifest, ``specdec draft publish``; docs/security.md says what a device then holds).
    None = no delivery (the calls answer NOT_FOUND / an empty list)."""

    default_draft: str | None = None
    """The draft name ResolveDraft answers when the edge names none; None = the first name (sorted) the caller's
    tenant may fetch."""

    draft_baseline_blocks: int = Field(200, ge=1)
    """A delivered draft version's baseline acceptance: its first this-many verify steps (all replicas), blocks."""

    draft_window_blocks: int = Field(200, ge=1)
    """The watchdog's window: a version's last this-many verify steps on this replica, blocks."""

    draft_watchdog_margin: float = Field(0.2, gt=0, le=1)
    """A version whose windowed acceptance rate is below its baseline by more than this is quarantined."""

    draft_canary_min_blocks: int = Field(200, ge=1)
    """Verify steps a canary and the current version each need before the canary is promoted or rolled back."""

    draft_canary_margin: float = Field(0.05, ge=0, le=1)
    """How much worse a canary may measure (acceptance rate, absolute; mean accepted length, relative) and still
    be promoted."""

    port: int = Field(50051, ge=0, le=65535)
    """gRPC port (0 = pick a free port)."""

    redis_url: str | None = None
    """Redis URL of the session store; None = in-process store (one replica). ``redis://[user:pass@]host:port/db``
    (``rediss://`` TLS); ``redis+sentinel://[user:pass@]h1:p1,h2:p2/service_name[/db]`` (``rediss+sentinel://``):
    the master the sentinels name; ``redis+cluster://[user:pass@]h1:p1,h2:p2`` (``rediss+cluster://``): a Redis
    Cluster. Choosing one: docs/session-store.md."""

    redis_sentinel_username: str | None = None
    """ACL user of the sentinels themselves (the URL's credentials are the data nodes'); None = none."""

    redis_sentinel_password: SecretStr | None = None
    """Password of the sentinels (``requirepass`` in sentinel.conf); None = none."""

    redis_tls_ca_file: str | None = None
    """PEM CA bundle that signed the Redis/sentinel certificates of a ``rediss+sentinel://`` or
    ``rediss+cluster://`` URL (``rediss://`` takes ``?ssl_ca_certs=``); None = the system CAs."""

    redis_socket_timeout_s: float = Field(5.0, gt=0)
    """Connect and read timeout of one Redis call, seconds."""

    redis_failover_retry_s: float = Field(10.0, ge=0)
    """Sentinel/Cluster: how long a store call retries (backoff 50 ms doubling to 1 s) while a new master is
    found, seconds; past it the block is answered UNAVAILABLE (the SDK retries). A standalone Redis: no retry."""

    redis_wait_replicas: int = Field(0, ge=0)
    """Replicas each commit must reach before its verdict is sent (``WAIT n``); 0 = off (asynchronous
    replication: a master failover may lose the last commits, docs/session-store.md)."""

    redis_wait_timeout_ms: int = Field(500, ge=1)
    """How long a commit waits for ``redis_wait_replicas`` acknowledgements, ms (fewer: the commit is
    unconfirmed, UNAVAILABLE)."""

    redis_prefix: str = "specdec:v1:"
    """Namespace prepended to every Redis key of this deployment."""

    target: str | None = None
    """Directory of the target model (HF format); None = the default prepared model (`specdec models prepare`)."""

    model_id: str | None = None
    """Model id reported to clients and stored per session; None = the target directory's name."""

    verifier_id: str = Field(default_factory=_default_verifier_id)
    """Id of this replica (stored with each session it holds); default ``<hostname>-<pid>``."""

    session_ttl_s: int = Field(600, ge=1)
    """Session time-to-live without activity, seconds (Redis key TTL and KV-cache reaping)."""

    reap_interval_s: float = Field(5.0, gt=0)
    """Period of the reaper that frees the KV caches of expired sessions, seconds."""

    max_num_speculative_tokens: int = Field(16, ge=1, le=MAX_NUM_SPECULATIVE_TOKENS)
    """Largest draft block accepted, tokens (γ_max; at most common.types.MAX_NUM_SPECULATIVE_TOKENS)."""

    max_sessions: int = Field(256, ge=1)
    """Most sessions held at once by this replica (RESOURCE_EXHAUSTED past it)."""

    max_batch_size: int = Field(32, ge=1)
    """Most draft blocks verified in one target forward pass, blocks."""

    max_batch_wait_ms: float = Field(2.0, ge=0)
    """How long the batcher waits for more blocks once one is queued, milliseconds."""

    straggler_wait_fraction: float = Field(0.05, ge=0, le=1)
    """How long the batcher waits for the next blocks of the sessions its last step answered (and did not finish),
    as a fraction of the last forward pass: a block that misses a step waits a whole forward pass."""

    kv_cache_budget_tokens: int = Field(262144, ge=1)
    """Total target KV-cache budget over all sessions, tokens (RESOURCE_EXHAUSTED past it)."""

    kv_page_size: int = Field(16, ge=1, le=1024,
                              validation_alias=AliasChoices("SPECDEC_KV_PAGE_SIZE", DEPRECATED_KV_PAGE_SIZE_ENV))
    """Tokens per page of the paged KV pool (sessions use whole pages; prefix caching shares whole pages).
    ``SPECDEC_KV_BLOCK_SIZE`` (its former name: "block" now means only a draft block) is still read, with a
    warning, for one release; ``SPECDEC_KV_PAGE_SIZE`` wins when both are set."""

    verify_policy: Literal["fixed", "adaptive"] = "adaptive"
    """How much of each draft block a batch step verifies: ``adaptive`` (per row, the prefix that maximises the
    step's expected committed tokens per second, from a profiled cost model and the calibrated draft confidence;
    the default: docs/verification.md has the measurements) or ``fixed`` (every drafted position); lossless either
    way."""

    prefill_chunk_tokens: int = Field(256, ge=1)
    """Prompt tokens per prefill forward pass (chunked prefill), tokens."""

    metrics_port: int | None = Field(9090, ge=0, le=65535)
    """Port of the Prometheus /metrics HTTP endpoint; 0 or None = off."""

    grace_period_s: float = Field(10.0, ge=0)
    """Shutdown grace period: time given to in-flight blocks after SIGTERM/SIGINT, seconds."""

    torch_threads: int | None = Field(None, ge=1)
    """torch intra-op threads (``torch.set_num_threads``); None = torch's default."""

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    """Device of the target model: ``auto`` (CUDA when ``torch.cuda.is_available()``, else CPU), ``cpu``,
    ``cuda`` or ``cuda:N``. A CUDA device where CUDA is not available is an error at startup."""

    tensor_parallel: int = Field(1, ge=1, le=64)
    """Ranks the target is sharded over (Megatron-style tensor parallelism on torch.distributed,
    :mod:`cloud_verifier.parallel`): one per device (``cuda:0..N-1``, NCCL) or N CPU processes (gloo), started
    by ``serve`` itself (or by torchrun). 1 = one device. Not with hybrid targets other than LFM2 or ``compile``
    other than off."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and KV cache of the target: ``auto`` = bfloat16 on CUDA, float32 on CPU."""

    compile: Literal["off", "torch_compile", "cuda_graphs"] = "off"
    """How the target's verify/decode forward runs (:mod:`cloud_verifier.target.compiled_forward`): ``off`` = eagerly;
    ``torch_compile`` = decoder + LM head through ``torch.compile`` (dynamic shapes; the first passes compile,
    seconds to minutes); ``cuda_graphs`` = captured CUDA graphs for uniform verify/decode batches (rows bucketed
    to powers of two; prefill stays eager), eager with one log line off CUDA. Off by default: on the CPU the
    compiled forward was measured 2-3x slower than eager (specdec.bench.compile_bench)."""

    health_check_interval_s: float = Field(1.0, ge=0)
    """Period of the health task (session store ping, batch-loop heartbeat), seconds; 0 = no health task."""

    batch_stuck_after_s: float = Field(60.0, gt=0)
    """Health turns NOT_SERVING when the batch loop has not beaten for this long (stuck forward pass), seconds."""

    prefix_caching: bool = True
    """Automatic prefix caching: full KV pages of committed tokens are shared by every session whose tokens up to
    them are identical (a prompt starting with a cached prefix prefills only the rest); False = off."""

    prefix_cache_salt: Literal["none", "tenant"] = "none"
    """Who shares cached KV pages: ``none`` = every tenant (vLLM's default; a cached prefix opens faster, which
    another tenant can time: docs/security.md), ``tenant`` = only sessions of the same tenant (the tenant id
    salts the page hashes)."""

    @model_validator(mode="after")
    def _warn_deprecated_names(self) -> "VerifierSettings":
        if any(name.upper() == DEPRECATED_KV_PAGE_SIZE_ENV for name in os.environ):
            log.warning("%s is deprecated and will be dropped in the next release: use SPECDEC_KV_PAGE_SIZE "
                        "(the same setting)", DEPRECATED_KV_PAGE_SIZE_ENV)
        return self
