"""The batcher's straggler wait: after a step, it waits up to ``straggler_wait_fraction`` of the last forward
pass for the next blocks of the sessions that step answered (and did not finish), beyond ``max_batch_wait_ms``;
a block that misses a step otherwise waits a whole forward pass. The collection policy alone, on the real
Batcher with its real queue: two sessions the last step answered, one block queued at once and one 30 ms later."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from specdec_runtime.cloud_verifier.batcher import Batcher
from specdec_runtime.cloud_verifier.work import Work
from specdec_runtime.common.types import DraftBlock

LAST_FORWARD_S = 0.4  # the previous step's forward pass, s
LATE_S = 0.03  # the second session's block arrives this long after the first


def _collect(fraction: float, returning: bool = True) -> int:
    sessions = [SimpleNamespace(kv=SimpleNamespace(order=i)) for i in range(2)]
    batcher = Batcher(None, None, SimpleNamespace(num_sessions=3, prefill_chunk_tokens=256), valid_vocab_size=10,
                      max_batch_size=8, max_batch_wait_ms=1.0, straggler_wait_fraction=fraction)
    batcher._prev_forward_s = LAST_FORWARD_S
    batcher._returning = {id(s) for s in sessions} if returning else set()

    async def run() -> int:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Work] = asyncio.Queue()
        works = [Work(s, [1, 2], 0, loop.create_future(), block=DraftBlock([2])) for s in sessions]
        queue.put_nowait(works[0])
        loop.call_later(LATE_S, queue.put_nowait, works[1])
        batch = await batcher._collect(queue, loop)
        return len(batch)

    try:
        return asyncio.run(run())
    finally:
        batcher.close()


def test_a_returning_sessions_late_block_joins_the_step():
    assert _collect(0.5) == 2  # waited up to 200 ms for it: it came at 30 ms


def test_without_the_straggler_wait_the_late_block_misses_the_step():
    assert _collect(0.0) == 1  # negative control: only max_batch_wait_ms (1 ms)


def test_no_wait_for_sessions_the_last_step_did_not_answer():
    assert _collect(0.5, returning=False) == 1
