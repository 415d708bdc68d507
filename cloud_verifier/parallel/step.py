"""One tensor-parallel forward step: rank 0 broadcasts the step's inputs, every rank runs the same decoder pass.

Rank 0 (which owns sessions, page tables and the batcher) builds the step's :class:`PagedBatch` as the
single-device runner does; :class:`StepBroadcaster` (rank 0's decoder) then sends, with two
``torch.distributed.broadcast`` calls from rank 0, a header int64 [6] (command, T tokens, R rows, payload length,
reference flag, Q released states) and a payload int64: the token ids [T], the positions [T], (first flat index,
n, start position) of each row [3R], the length of each row's page table [R], each row's recurrent-state id [R]
(-1: an attention-only target), the ids of the recurrent states rank 0 dropped since the last step [Q], and the
page tables. Every other rank (:func:`serve_steps`) rebuilds the same batch over its own KV pool (same page ids,
its own heads) and runs its decoder shard; the row-parallel all-reduces inside keep the ranks in step. Only rank 0
runs the LM head.

Hybrid targets: rank 0 owns each session's :class:`~cloud_verifier.kv.recurrent_state.SessionState` (on its
``SessionKV``); every other rank keeps a mirror of it under the id rank 0 gives it (:class:`StateIds`), holding
its own channels of the same layers at the same positions: it moves the same way because it sees the same rows (a fresh state, a
replay to the accepted prefix, the end state) and is dropped when rank 0's state is (preemption, a closed
session: a weakref finalizer on rank 0's state).

Commands: :data:`FORWARD`, :data:`NOOP` (a heartbeat while idle: a rank waiting in a broadcast would otherwise
reach the process group's timeout), :data:`STOP` (the ranks leave their loop).
"""

from __future__ import annotations

import collections
import logging
import weakref

import torch
import torch.distributed as dist

from specdec_runtime.cloud_verifier.kv.recurrent_state import SessionState
from specdec_runtime.cloud_verifier.target.attention import PagedBatch

FORWARD, NOOP, STOP = 1, 2, 3
HEADER = 6
log = logging.getLogger(__name__)


class StateIds:
    """Rank 0: an integer id for each session's recurrent state, and the ids of the states dropped since the last
    step (a weakref finalizer per state queues its id, from whichever thread drops the last reference)."""

    def __init__(self):
        self._ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.issued = 0  # ids given out so far (the next id)
        self._released: collections.deque[int] = collections.deque()

    def of(self, state: SessionState) -> int:
        sid = self._ids.get(state)
        if sid is None:
            sid = self._ids[state] = self.issued
            self.issued += 1
            weakref.finalize(state, self._released.append, sid)
        return sid

    def take_released(self) -> list[int]:
        out = []
        while self._released:
            out.append(self._released.popleft())
        return out


def _encode(batch: PagedBatch, input_ids: torch.Tensor, position_ids: torch.Tensor, states: StateIds,
            released: list[int]) -> list[int]:
    rows = [x for _, begin, n, start in batch.rows for x in (begin, n, start)]
    lens = [len(pages) for pages, _, _, _ in batch.rows]
    ids = [states.of(state) for state, _, _, _ in batch.recurrent] or [-1] * len(batch.rows)
    pages = [p for table, _, _, _ in batch.rows for p in table]
    return input_ids[0].tolist() + position_ids[0].tolist() + rows + lens + ids + released + pages


def broadcast_command(cmd: int, group, device: torch.device,
                      sizes: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)) -> None:
    """Rank 0: send a header (``cmd`` and the payload's sizes) to every rank."""
    dist.broadcast(torch.tensor([cmd, *sizes], dtype=torch.long, device=device), 0, group=group)


class StepBroadcaster:
    """Rank 0's decoder: broadcasts each step's inputs, then runs the local decoder shard.

    Called like the HF decoder (``input_ids`` [1, T], ``position_ids`` [1, T], ``specdec_batch``); returns its
    output. ``before`` is called first (it raises when a rank has failed), ``after`` once the pass ended;
    ``on_error`` gets the exception of a failed collective and returns the exception to raise instead.
    """

    def __init__(self, decoder, group, device: torch.device, before, after, on_error):
        self.inner = decoder
        self.group = group
        self.device = device
        self.before = before
        self.after = after
        self.on_error = on_error
        self.states = StateIds()

    def __getattr__(self, name):  # anything else (config, layers, ...) is the wrapped decoder's
        return getattr(self.inner, name)

    def __call__(self, input_ids, position_ids, specdec_batch: PagedBatch, **kwargs):
        self.before()
        try:
            released = self.states.take_released()
            payload = _encode(specdec_batch, input_ids, position_ids, self.states, released)
            sizes = (input_ids.shape[1], len(specdec_batch.rows), len(payload), int(specdec_batch.reference),
                     len(released))
            broadcast_command(FORWARD, self.group, self.device, sizes)
            dist.broadcast(torch.tensor(payload, dtype=torch.long, device=self.device), 0, group=self.group)
            out = self.inner(input_ids=input_ids, position_ids=position_ids, specdec_batch=specdec_batch, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a collective failed (a rank died or timed out), or rank 0 left
            # the step midway: the other ranks are no longer in step with it, the group cannot go on
            raise self.on_error(exc) from exc
        self.after()
        return out


def _decode(payload: torch.Tensor, sizes: list[int], pool, device: torch.device, states: dict) -> tuple:
    """(batch, input_ids [1, T], position_ids [1, T]) from a step's payload; ``states`` (id -> this rank's
    :class:`SessionState`) loses the released ids and gains the new ones."""
    t, r, _, reference, q = sizes
    values = payload.tolist()
    ids, pos = values[:t], values[t : 2 * t]
    rows = values[2 * t : 2 * t + 3 * r]
    lens = values[2 * t + 3 * r : 2 * t + 4 * r]
    state_ids = values[2 * t + 4 * r : 2 * t + 5 * r]
    for sid in values[2 * t + 5 * r : 2 * t + 5 * r + q]:
        states.pop(sid, None)
    pages, at = values[2 * t + 5 * r + q :], 0
    batch = PagedBatch(pool, reference=bool(reference))
    for i in range(r):
        batch.add_row(pages[at : at + lens[i]], rows[3 * i], rows[3 * i + 1], rows[3 * i + 2])
        at += lens[i]
        if state_ids[i] >= 0:
            batch.recurrent.append((states.setdefault(state_ids[i], SessionState()), *rows[3 * i : 3 * i + 3]))
    batch.finish(device)
    as_ids = lambda x: torch.tensor([x], dtype=torch.long, device=device)  # noqa: E731
    return batch, as_ids(ids), as_ids(pos)


def serve_steps(runner, group) -> int:
    """A rank > 0: run the forward of every step rank 0 broadcasts, until :data:`STOP`. Returns the steps run.

    Raises:
        RuntimeError: a collective failed (rank 0 died, or the process group timed out).
    """
    device = runner.device
    header = torch.empty(HEADER, dtype=torch.long, device=device)
    steps, states = 0, {}
    with torch.inference_mode():
        while True:
            dist.broadcast(header, 0, group=group)
            cmd, *sizes = header.tolist()
            if cmd == STOP:  # the states held: those rank 0 still held at its last step (a leak shows here)
                log.info("tensor-parallel rank %d: stopped after %d steps, %d recurrent states held",
                         dist.get_rank(group), steps, len(states))
                return steps
            if cmd != FORWARD:
                continue
            payload = torch.empty(sizes[2], dtype=torch.long, device=device)
            dist.broadcast(payload, 0, group=group)
            batch, input_ids, position_ids = _decode(payload, sizes, runner.kv_pool, device, states)
            runner.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, specdec_batch=batch)
            for state, _, n, start in batch.recurrent:  # as rank 0's runner does after the pass
                state.finish(start, n)
            steps += 1
