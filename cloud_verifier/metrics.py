"""Prometheus metrics of the verifier (prometheus-client; served on an HTTP /metrics port).

Names follow vLLM's speculative decoding counters (``vllm:spec_decode_num_drafts`` ...), prefixed
``specdec_``. Mean accepted length = 1 + num_accepted_tokens / num_drafts; acceptance rate =
num_accepted_tokens / num_draft_tokens (derive them in PromQL from the counters, as vLLM does).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

NUM_DRAFTS = Counter("specdec_spec_decode_num_drafts", "Verify steps (draft blocks verified)")
NUM_DRAFT_TOKENS = Counter("specdec_spec_decode_num_draft_tokens", "Draft tokens received for verification")
NUM_ACCEPTED_TOKENS = Counter("specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted")
NUM_ACCEPTED_TOKENS_PER_POS = Counter(
    "specdec_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by block position", ["position"]
)
NUM_EMITTED_TOKENS = Counter("specdec_generation_tokens", "Tokens committed (accepted + recovered/bonus)")
FORWARD_PASSES = Counter("specdec_target_forward_passes", "Target forward passes")
BATCH_SIZE = Histogram(
    "specdec_batch_size", "Draft blocks verified per target forward pass", buckets=(1, 2, 4, 8, 16, 32, 64, 128)
)
BATCH_TOKENS = Histogram(
    "specdec_batch_tokens", "Tokens per target forward pass (blocks + prefill chunks)",
    buckets=(1, 4, 16, 64, 128, 256, 512, 1024, 2048),
)
QUEUE_WAIT = Histogram(
    "specdec_queue_wait_seconds", "Time a draft block waited in the batch queue, s",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)
FORWARD_TIME = Histogram(
    "specdec_target_forward_seconds", "Wall time of one target forward pass, s",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
BATCH_STEP = Histogram(
    "specdec_batch_step_seconds", "Wall time of one batch step, s: from its first item taken off the queue to its "
    "answers (collecting, building rows, forward, verdicts, stopping, commits)", buckets=STEP_BUCKETS,
)
BATCH_HOST = Histogram(
    "specdec_batch_host_seconds", "Host time of one batch step outside the target forward pass (step - forward), s",
    buckets=STEP_BUCKETS,
)
BATCH_COLLECT = Histogram(
    "specdec_batch_collect_seconds", "Collecting part of a batch step's host time (waiting up to max_batch_wait_ms "
    "for more items included), s", buckets=STEP_BUCKETS,
)
SESSIONS_OPEN = Gauge("specdec_sessions_open", "Sessions held by this verifier")
SESSIONS_OPENED = Counter("specdec_sessions_opened", "Sessions opened")
SESSIONS_CLOSED = Counter("specdec_sessions_closed", "Sessions closed by their client")
SESSIONS_EXPIRED = Counter("specdec_sessions_expired", "Sessions freed after their TTL")
SESSIONS_RESUMED = Counter("specdec_sessions_resumed", "Sessions resumed from the store on this replica")
KV_CACHE_USED_BYTES = Gauge("specdec_kv_cache_used_bytes", "KV cache in use: pages held by sessions, bytes")
KV_CACHE_CAPACITY_BYTES = Gauge("specdec_kv_cache_capacity_bytes", "KV cache budget, bytes")
KV_CACHE_PAGES_USED = Gauge("specdec_kv_cache_pages_used", "KV pages held by sessions (paged pool)")
KV_CACHE_PAGES_TOTAL = Gauge("specdec_kv_cache_pages_total", "KV pages in the paged pool")


VERIFY_POSITIONS = Counter(
    "specdec_verify_positions", "Draft tokens of verify rows: drafted (whole blocks as sent) and verified (judged by "
    "the rejection rule; fewer when adaptive verification verified a prefix)", ["kind"])
VERIFY_COST = Gauge("specdec_verify_cost_seconds", "The verify policy's cost model: target forward s = base + per_row "
                    "· rows + per_token · tokens (a saved table or a probe at start, profiled in the background, "
                    "refreshed from live steps)", ["term"])
VERIFY_CALIBRATION_ERROR = Gauge(
    "specdec_verify_calibration_error", "Expected calibration error of the acceptance estimate over the verdicts "
    "so far: of the raw draft confidence, and of the calibrated estimate", ["estimate"])


def observe_verify_positions(num_drafted: int, num_verified: int) -> None:
    VERIFY_POSITIONS.labels("drafted").inc(num_drafted)
    VERIFY_POSITIONS.labels("verified").inc(num_verified)


def export_verify_policy(report: dict) -> None:
    """Set the cost-model and calibration gauges from a :meth:`cloud_verifier.verify_policy.VerifyPolicy.report`."""
    for term, seconds in report["cost_model_s"].items():
        VERIFY_COST.labels(term).set(seconds)
    for estimate in ("raw", "calibrated"):
        VERIFY_CALIBRATION_ERROR.labels(estimate).set(report["calibration_error"][estimate])


def observe_forward(seconds: float, num_blocks: int, num_tokens: int) -> None:
    FORWARD_PASSES.inc()
    FORWARD_TIME.observe(seconds)
    BATCH_TOKENS.observe(num_tokens)
    if num_blocks:
        BATCH_SIZE.observe(num_blocks)
        # the load hint of OpenSessionResponse (forward_ms): an EWMA over passes with verify rows, 1/8 weight
        prev = _recent["forward_ms"]
        _recent["forward_ms"] = seconds * 1000 if prev == 0.0 else prev + (seconds * 1000 - prev) / 8


def observe_step(step_s: float, forward_s: float, collect_s: float) -> None:
    """Count one batch step: its wall time, its host part (``step_s - forward_s``) and the collecting part of
    that, all s. The host share of the step is ``rate(specdec_batch_host_seconds_sum) /
    rate(specdec_batch_step_seconds_sum)``."""
    BATCH_STEP.observe(step_s)
    BATCH_HOST.observe(max(0.0, step_s - forward_s))
    BATCH_COLLECT.observe(collect_s)


_recent = {"forward_ms": 0.0}  # process-wide, like the counters


def recent_forward_ms() -> float:
    """Recent mean wall time of a target forward pass with verify rows, ms (EWMA; 0 before the first)."""
    return _recent["forward_ms"]


def observe_verdict(num_draft_tokens: int, num_accepted: int, num_committed: int, queue_wait_s: float,
                    draft=None) -> None:
    """Count one verdict: draft tokens sent, accepted, committed (accepted + recovered/bonus, cut at a stop);
    ``draft``: the session's draft-version tally (cloud_verifier.drafts.ledger.DraftTally), None = unlabelled."""
    if draft is not None:
        draft.observe(num_draft_tokens, num_accepted, num_committed)
    NUM_DRAFTS.inc()
    NUM_DRAFT_TOKENS.inc(num_draft_tokens)
    NUM_ACCEPTED_TOKENS.inc(num_accepted)
    NUM_EMITTED_TOKENS.inc(num_committed)
    for pos in range(num_accepted):
        NUM_ACCEPTED_TOKENS_PER_POS.labels(position=str(pos)).inc()
    QUEUE_WAIT.observe(queue_wait_s)


def serve_metrics(port: int, addr: str = "127.0.0.1") -> None:
    """Start the HTTP /metrics endpoint (a daemon thread) on ``addr``:``port`` (plaintext, no authentication:
    counters only; expose it to the scraper only, docs/security.md)."""
    start_http_server(port, addr=addr)


# verify rows refused because the target's logits were NaN/inf or left no distribution
# (cloud_verifier/verdict/numerics.py)
NONFINITE_LOGITS = Counter("specdec_nonfinite_logits", "Verify rows whose target logits were not finite "
                           "(NaN, +inf, no finite logit) or left no distribution to sample from")

# the session store (cloud_verifier/store/redis_connect.py): every command's latency, retries included
STORE_LATENCY = Histogram(
    "specdec_store_command_seconds", "Latency of one session-store command (retries after a failover included), s",
    ["command"], buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0),
)
STORE_FAILOVERS = Counter("specdec_store_failovers", "Store calls that ended on another Redis master than they "
                          "started with (Sentinel promotion, Cluster failover)")
STORE_ERRORS = Counter("specdec_store_unavailable", "Store calls given up as unreachable (answered UNAVAILABLE)",
                       ["command"])

# cloud decode (cloud_verifier/serving/decode_stream.py): Decode calls and the tokens they generated
DECODE_STREAMS = Counter("specdec_decode_streams", "Decode calls (cloud decode: the verifier generates the tokens)")
DECODE_TOKENS = Counter("specdec_decode_tokens", "Tokens generated by cloud decode (γ = 0 verify steps)")

# automatic prefix caching (cloud_verifier/kv/prefix_cache.py), as vLLM's vllm:prefix_cache_queries / _hits: tokens
PREFIX_CACHE_QUERIES = Counter("specdec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                               "(the full KV pages of an opened, resumed or extended session's tokens but the last)")
PREFIX_CACHE_HITS = Counter("specdec_prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled)")
PREFIX_CACHE_EVICTIONS = Counter("specdec_prefix_cache_evicted_pages", "Cached KV pages evicted (LRU) for reuse")

# tensor parallel (cloud_verifier.parallel): per-rank memory, rank 0's all-reduce time per forward pass
TP_WORLD_SIZE = Gauge("specdec_tp_world_size", "Tensor-parallel ranks of this replica's target (1 = one device)")
TP_RANK_WEIGHT_BYTES = Gauge("specdec_tp_rank_weight_bytes", "Target weights held by each tensor-parallel rank, bytes",
                             ["rank"])
TP_RANK_KV_BYTES = Gauge("specdec_tp_rank_kv_bytes", "KV pool of each tensor-parallel rank (its KV heads), bytes",
                         ["rank"])
TP_ALLREDUCE_TIME = Histogram("specdec_tp_allreduce_seconds", "Rank 0's all-reduce wall time per target forward pass",
                              buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0))
