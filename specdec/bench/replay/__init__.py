"""The verifier under load (``specdec bench --replay --clients 1,16,64``): recorded draft blocks replayed by ONE
asyncio process against a verifier in its own process, so the numbers measure the service, not the box.

1. **Record** (once, cached): a real edge client (the default ONNX draft, greedy, fixed γ = 4, no confidence
   truncation, no proactive drafting) runs every prompt against an in-process verifier; per prompt we keep the
   sequence of blocks it sent (``seq``, ``committed_length``, draft ids) and the verdicts it got
   (``num_accepted``, ``next_token_id``, ``committed_length``, ``finished``). The cache file lives under
   ``<model cache>/replay/`` and is keyed by the prompts file's hash, the limit, the target and draft
   fingerprints, the device/dtype, γ and max_new_tokens.
2. **Replay**: two ``specdec serve`` processes on loopback, pinned to the same cores (all but the first
   allowed core; the load generator gets the first), one batched (``max_batch_size`` ≥ N), one forced to one
   block per forward pass (``SPECDEC_MAX_BATCH_SIZE=1``); only one is driven at a time. N concurrent sessions
   in this process (one grpc.aio channel and one ``Verify`` stream each): a session opens with its prompt,
   sends its next recorded block as soon as the previous verdict arrives, opens the next prompt when one
   finishes, until the window ends. The window (``duration_s``) starts once every session has had its first
   verdict: N sessions opening at once put N prompts' prefill in the queue, which is no steady state (``ramp_s``
   reports it). Greedy verdicts are deterministic: each verdict must equal the recorded one (a difference is a
   *mismatch*; the session is abandoned and closed). The one-block-per-forward verifier is driven by
   the same N sessions: its throughput does not depend on N, and the same sessions put blocks of the same depth
   in both windows (with 2 sessions it verified the first ~80 blocks of two prompts, 4–7 % more tokens per block
   at N = 64 and 256 than the batched window's first blocks of all 16: a bias of the tokens ratio, not of the verifier).
3. **Kernel limit** (same run, verifiers idle, this process pinned to the verifiers' cores with their thread
   count): N single-row target forwards of γ + 1 tokens vs ONE N-row forward over the same contexts (the
   contexts of recorded sessions half-way through; the KV content does not change the timing, so it is zeros).
   Prefill is left out of it, and on a CPU it does not batch (compute-bound); ``kernel.prefill_share`` adds the
   workload's prefill to both sides: the speedup the kernel allows for this workload.
4. **Memory**: the batched verifier's ``specdec_kv_cache_used_bytes`` (from its /metrics) and VmRSS (from
   /proc/PID/status) when idle before each N, their peak during it, and after it (every session closed).
5. **Host time per step**: the batched verifier's mean time per batch step outside the target forward pass
   (``host_ms_per_step``) and its share of the step (``host_fraction_of_step``), from its batcher's
   ``specdec_batch_*_seconds`` histograms read at the window's start and end (:mod:`.host_time`).

Every rate is a ratio of sums: committed tokens of verdicts received inside the window / the window. The same
ratios per CPU second of the verifier process (``*_cpu``) take out what other jobs of a shared machine take from
its cores.

Modules: :mod:`.recording` (1), :mod:`.sessions` (2: the replayed sessions), :mod:`.kernel` (3),
:mod:`.memory` (4), :mod:`.host_time` (5), :mod:`.run` (the whole run, each N measured), :mod:`.report` (the table).
"""

from __future__ import annotations

from .host_time import host_time_fields, read_step_times
from .kernel import KERNEL_REPEATS, measure_kernel_limit
from .memory import RSS_IDLE_TOLERANCE, RSS_IDLE_TOLERANCE_BYTES, verifier_memory
from .recording import (
    REPLAY_FORMAT, RecordedPrompt, RecordedStep, Recording, load_or_record, record_blocks, recording_key,
)
from .report import print_replay_report
from .run import (
    REPLAY_DEFAULT_DURATION_S, REPLAY_DEFAULT_LIMIT, REPLAY_WARMUP_S, run_replay_bench,
)
from .sessions import ReplayTally, replay_sessions

__all__ = [
    "KERNEL_REPEATS",
    "REPLAY_DEFAULT_DURATION_S",
    "REPLAY_DEFAULT_LIMIT",
    "REPLAY_FORMAT",
    "REPLAY_WARMUP_S",
    "RSS_IDLE_TOLERANCE",
    "RSS_IDLE_TOLERANCE_BYTES",
    "RecordedPrompt",
    "RecordedStep",
    "Recording",
    "ReplayTally",
    "host_time_fields",
    "load_or_record",
    "measure_kernel_limit",
    "print_replay_report",
    "read_step_times",
    "record_blocks",
    "recording_key",
    "replay_sessions",
    "run_replay_bench",
    "verifier_memory",
]
