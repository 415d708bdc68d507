"""Replaying: N concurrent sessions of one asyncio process send recorded blocks to a verifier over gRPC, each
verdict checked against the recorded one, verdicts counted inside a measured window."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from .._shared import safe_ratio
from .recording import RecordedPrompt


@dataclass
class ReplayTally:
    """What N replayed sessions saw (verdicts counted when received inside the window)."""

    tokens: int = 0
    verdicts: int = 0
    batch_size_sum: int = 0
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    mismatches: int = 0
    sessions_started: int = 0
    sessions_completed: int = 0
    error_samples: list[str] = field(default_factory=list)
    mismatch_samples: list[dict] = field(default_factory=list)
    window_s: float = 0.0
    ramp_s: float = 0.0  # from the start to the window: until every session slot had its first verdict
    ramp_timed_out: bool = False  # the window started after ramp_timeout_s, some slot still without a verdict
    drain_s: float = 0.0  # from the end of the window to the last session closed
    slot_rate_sum: float = 0.0  # sum over slots of their steady rates, tokens/s (see steady_tokens_per_s)
    slot_verdict_rate_sum: float = 0.0  # the same in verdicts (blocks verified) per second
    verified_positions: int = 0  # draft tokens the verifier judged, in-window verdicts (all sent: no cut)

    def add_slot(self, first_t: float | None, last_t: float | None, tokens_after_first: int,
                 tokens_in_window: int, verdicts_after_first: int = 0, verdicts_in_window: int = 0) -> None:
        """One slot's share of :meth:`steady_tokens_per_s` (and of :meth:`steady_verdicts_per_s`, from the
        verdict counts): tokens after its first in-window verdict / the time from that verdict to its last one
        (s); a slot with fewer than two in-window verdicts counts its window tokens over the whole window."""
        if first_t is not None and last_t is not None and last_t > first_t:
            self.slot_rate_sum += tokens_after_first / (last_t - first_t)
            self.slot_verdict_rate_sum += verdicts_after_first / (last_t - first_t)
        elif self.window_s > 0:
            self.slot_rate_sum += tokens_in_window / self.window_s
            self.slot_verdict_rate_sum += verdicts_in_window / self.window_s

    def steady_tokens_per_s(self) -> float | None:
        """Throughput measured between verdicts, summed over slots: each slot's committed tokens from its first
        to its last verdict inside the window over that span. Unlike tokens / window it does not depend on where
        the window cuts a batch step: the window opens at a verdict, so tokens / window also counts the rest of
        that step's verdicts, computed before the window (at N = 256 with ~18 s steps: 1.75x the rate), and
        leaves out the step the window's end cuts."""
        return round(self.slot_rate_sum, 2) if self.slot_rate_sum > 0 else None

    def steady_verdicts_per_s(self) -> float | None:
        """Blocks verified per second, measured as :meth:`steady_tokens_per_s` is: the rate the kernel limit
        compares (rows verified), whatever the recorded acceptance of the blocks this replay happened to reach."""
        return round(self.slot_verdict_rate_sum, 3) if self.slot_verdict_rate_sum > 0 else None

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])


def _rpc_error_text(e: BaseException) -> str:
    code = getattr(e, "code", None)
    details = getattr(e, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return f"{type(e).__name__}: {e}"


async def replay_sessions(address: str, prompts: list[RecordedPrompt], n: int, duration_s: float, *,
                          max_new_tokens: int, tokenizer_fingerprint: str = "", ramp_timeout_s: float = 300.0,
                          open_timeout_s: float = 300.0, verify_timeout_s: float = 60.0,
                          on_window=None, cloud: bool = False) -> ReplayTally:
    """N concurrent sessions replaying recorded blocks against the verifier at ``address`` (see the module
    docstring); every session asks for the recording's ``max_new_tokens`` (the recorded finish states depend
    on it). All N sessions open at once; the measured window of ``duration_s`` s starts when every slot has had
    its first verdict (the initial burst of N prefills is not steady state), or after ``ramp_timeout_s`` s.
    Errors and mismatches count from the start. Must run on an asyncio loop; returns when every session is
    closed. Deadlines are the SDK's defaults (GrpcBackend's OpenSession 300 s, EdgeClient's verify step 60 s):
    a session past one counts as an error. ``on_window``: called with "start" when the window opens and "end"
    when it closes (e.g. to read the verifier's CPU time). ``cloud``: each session is cloud-decoded instead (one
    Decode stream: the verifier generates the recorded output itself, a verdict per token, checked against the
    recorded output ids): the same sessions, for the capacity comparison of docs/routing.md."""
    run = _Replay(address, prompts, n, duration_s, max_new_tokens=max_new_tokens,
                  tokenizer_fingerprint=tokenizer_fingerprint, open_timeout_s=open_timeout_s,
                  verify_timeout_s=verify_timeout_s, on_window=on_window)
    run.cloud = cloud
    watchdog = asyncio.create_task(run.ramp_watchdog(ramp_timeout_s))
    try:
        slots = [_Slot(run) for _ in range(n)]
        results = await asyncio.gather(*(slot.run() for slot in slots), return_exceptions=True)
    finally:
        watchdog.cancel()
    run.close_window()
    tally = run.tally
    for r in results:
        if isinstance(r, BaseException):
            tally.error(f"session slot failed: {type(r).__name__}: {r}")
    end = run.loop.time()
    tally.window_s = duration_s if run.start is not None else 0.0
    for slot in slots:
        tally.add_slot(slot.first_t, slot.last_t, slot.tokens_after_first, slot.tokens_in_window,
                       slot.verdicts_after_first, slot.verdicts_in_window)
    tally.drain_s = max(0.0, end - run.end) if run.start is not None else 0.0
    return tally


class _Replay:
    """What the N session slots share: the tally, the measured window, the next recorded prompt to open."""

    def __init__(self, address: str, prompts: list[RecordedPrompt], n: int, duration_s: float, *,
                 max_new_tokens: int, tokenizer_fingerprint: str, open_timeout_s: float, verify_timeout_s: float,
                 on_window):
        self.address, self.prompts, self.n, self.duration_s = address, prompts, n, duration_s
        self.max_new_tokens, self.tokenizer_fingerprint = max_new_tokens, tokenizer_fingerprint
        self.open_timeout_s, self.verify_timeout_s, self.on_window = open_timeout_s, verify_timeout_s, on_window
        self.loop = asyncio.get_running_loop()
        self.tally = ReplayTally()
        self.next_index = 0
        self.t_start = self.loop.time()
        self.start: float | None = None  # the window, once every slot has had its first verdict
        self.end = float("inf")
        self.ready = 0  # slots that have had their first verdict
        self.cloud = False  # sessions cloud-decoded (Decode) instead of replaying the recorded blocks
        self._window_timer: asyncio.TimerHandle | None = None
        self._window_closed = False

    def open_window(self, timed_out: bool = False) -> None:
        if self.start is None:
            self.start = self.loop.time()
            self.end = self.start + self.duration_s
            self.tally.ramp_s = self.start - self.t_start
            self.tally.ramp_timed_out = timed_out
            if self.on_window is not None:
                self.on_window("start")
                self._window_timer = self.loop.call_later(self.duration_s, self.close_window)

    def close_window(self) -> None:
        """Call ``on_window("end")`` once: from the window's timer, or when the slots return first (every slot
        saw the window's end and closed before the timer's turn on the loop came)."""
        if self.start is not None and self.on_window is not None and not self._window_closed:
            self._window_closed = True
            self._window_timer.cancel()
            self.on_window("end")

    async def ramp_watchdog(self, ramp_timeout_s: float) -> None:
        await asyncio.sleep(ramp_timeout_s)
        self.open_window(timed_out=True)

    def next_prompt(self) -> RecordedPrompt:
        i = self.next_index
        self.next_index += 1
        return self.prompts[i % len(self.prompts)]

    def first_verdict(self) -> None:
        self.ready += 1
        if self.ready == self.n:
            self.open_window()

    def in_window(self) -> bool:
        return self.start is not None and self.loop.time() <= self.end


class _Slot:
    """One session slot: its channel and Verify stream; sessions one after the other until the window ends."""

    def __init__(self, replay: _Replay):
        self.r = replay
        self.stub = None
        self.call = None  # the Verify stream, kept across sessions (a new one after an error)
        self.had_verdict = False
        self.first_t: float | None = None  # perf_counter() of this slot's first verdict inside the window
        self.last_t: float | None = None  # ... and of its last
        self.tokens_after_first = 0  # committed tokens of its in-window verdicts after the first
        self.tokens_in_window = 0
        self.verdicts_after_first = 0
        self.verdicts_in_window = 0

    def count(self, tokens: int, batch_size: int, latency_s: float, t: float) -> None:
        """A verdict received inside the window, at perf_counter() ``t``: tallied, and this slot's span."""
        tally = self.r.tally
        tally.verdicts += 1
        tally.tokens += tokens
        tally.batch_size_sum += batch_size
        tally.latencies_s.append(latency_s)
        self.tokens_in_window += tokens
        self.verdicts_in_window += 1
        if self.first_t is None:
            self.first_t = t
        else:
            self.tokens_after_first += tokens
            self.verdicts_after_first += 1
        self.last_t = t

    async def run(self) -> None:
        import grpc

        from specdec_runtime.edge_client.transport.grpc_backend import CHANNEL_OPTIONS
        from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

        channel = grpc.aio.insecure_channel(self.r.address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.VerifierStub(channel)
        try:
            while self.r.loop.time() < self.r.end:
                await self._session(self.r.next_prompt())
        finally:
            if self.call is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.call.done_writing(), 5.0)
                    await asyncio.wait_for(self.call.read(), 5.0)  # EOF: the server ended the stream
                self.call.cancel()
            await channel.close()

    async def _session(self, p: RecordedPrompt) -> None:
        """Open a session for ``p``, replay its blocks, close it; errors are counted, not raised."""
        import grpc

        from specdec_runtime.common.types import SamplingParams, StoppingCriteria
        from specdec_runtime.common.wire import open_request_to_proto
        from specdec_runtime.common.v1 import verifier_pb2 as pb

        r, tally = self.r, self.r.tally
        request = open_request_to_proto(p.prompt_token_ids, SamplingParams(),
                                        StoppingCriteria(max_new_tokens=r.max_new_tokens), r.tokenizer_fingerprint)
        try:
            opened = await self.stub.OpenSession(request, timeout=r.open_timeout_s)
        except grpc.aio.AioRpcError as e:
            tally.error(f"OpenSession: {_rpc_error_text(e)}")
            await asyncio.sleep(0.05)
            return
        tally.sessions_started += 1
        sid = opened.session_id
        opened_ok = opened.committed_length == len(p.prompt_token_ids)
        if not opened_ok:
            tally.error(f"OpenSession: committed_length {opened.committed_length} != prompt length "
                        f"{len(p.prompt_token_ids)}")
        try:
            steps = self._decode if r.cloud else self._steps
            if opened_ok and await steps(p, sid) and r.start is not None:
                tally.sessions_completed += 1
        except (grpc.aio.AioRpcError, RuntimeError, asyncio.TimeoutError) as e:
            tally.error(f"Verify: {_rpc_error_text(e)}")
            if self.call is not None:
                self.call.cancel()
            self.call = None
        finally:
            try:
                await self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=r.verify_timeout_s)
            except grpc.aio.AioRpcError as e:
                tally.error(f"CloseSession: {_rpc_error_text(e)}")

    async def _steps(self, p: RecordedPrompt, sid: str) -> bool:
        """Send the recorded blocks one verdict after the other; True when all were sent and matched, False when
        the window ended first or a verdict differs from the recording (a mismatch).

        A verifier that verifies a prefix of a block (adaptive verification: ``num_verified_positions`` set)
        commits less than the recorded verdict: the next block is then the recorded block's unjudged draft tokens
        (what the draft proposed after that prefix), until the recorded committed lengths are reached again. Every
        verdict's committed tokens must be the recorded output's; a whole-block verdict on a recorded block must
        equal the recorded verdict."""
        import grpc

        from specdec_runtime.common.v1 import verifier_pb2 as pb

        r, tally = self.r, self.r.tally
        full = p.prompt_token_ids + p.output_token_ids
        c, seq = len(p.prompt_token_ids), 0
        while c < len(full) or seq == 0:
            if r.loop.time() >= r.end:
                return False
            step, offset = _block_at(p, c)
            if step is None:
                return self._mismatch(p, seq + 1, "a recorded block at", [c], [])
            seq += 1
            if self.call is None:
                self.call = self.stub.Verify()
            conf = step.draft_confidence[offset:] if step.draft_confidence else []
            msg = pb.DraftBlock(session_id=sid, seq=seq, committed_length=c,
                                draft_token_ids=step.draft_token_ids[offset:], draft_confidence=conf)
            t0 = time.perf_counter()
            v = await asyncio.wait_for(_exchange(self.call, msg), r.verify_timeout_s)
            t1 = time.perf_counter()
            if v is grpc.aio.EOF:
                raise RuntimeError("the Verify stream ended without a verdict")
            if not self.had_verdict:
                self.had_verdict = True
                r.first_verdict()
            elif r.in_window():
                self.count(v.committed_length - c, v.batch_size, t1 - t0, t1)
                tally.verified_positions += (v.num_verified_positions if v.HasField("num_verified_positions")
                                         else len(msg.draft_token_ids))
            got = (v.num_accepted, v.next_token_id, v.committed_length, v.finished)
            committed = list(msg.draft_token_ids[:v.num_accepted]) + ([v.next_token_id] if v.next_token_id >= 0 else [])
            cut = v.HasField("num_verified_positions")
            ok = v.seq == seq and v.committed_length - c <= len(committed) and \
                committed[:v.committed_length - c] == full[c:v.committed_length]
            ok = ok and v.finished == (v.committed_length >= step.verdict_committed_length and step.finished)
            if not cut and offset == 0 and got != step.expected():
                ok = False
            if not ok:
                return self._mismatch(p, seq, "verdict", list(step.expected()), list(got))
            c = v.committed_length
            if v.finished:
                return True
        return True

    def _mismatch(self, p: RecordedPrompt, seq: int, what: str, expected: list, got: list) -> bool:
        tally = self.r.tally
        tally.mismatches += 1
        if len(tally.mismatch_samples) < 5:
            tally.mismatch_samples.append({"question_id": p.question_id, "seq": seq, "what": what,
                                           "expected": expected, "got": got})
        return False

    async def _decode(self, p: RecordedPrompt, sid: str) -> bool:
        """Cloud decode of the session (one Decode stream from the prompt): True when the whole recorded output
        came and matched, False when the window ended first (the call is cancelled) or a token differs."""
        from specdec_runtime.common.v1 import verifier_pb2 as pb

        r, tally = self.r, self.r.tally
        call = self.stub.Decode(pb.DecodeRequest(session_id=sid, seq=1, committed_length=len(p.prompt_token_ids)))
        n, t0 = 0, time.perf_counter()
        try:
            async for v in call:
                t1 = time.perf_counter()
                if not self.had_verdict:
                    self.had_verdict = True
                    r.first_verdict()
                elif r.in_window():
                    self.count(1, v.batch_size, t1 - t0, t1)
                t0 = t1
                if n >= len(p.output_token_ids) or v.next_token_id != p.output_token_ids[n]:
                    tally.mismatches += 1
                    if len(tally.mismatch_samples) < 5:
                        tally.mismatch_samples.append({"question_id": p.question_id, "token": n,
                                                       "got": v.next_token_id})
                    return False
                n += 1
                if r.loop.time() >= r.end:
                    return False
            return n == len(p.output_token_ids)
        finally:
            call.cancel()


def _block_at(p: RecordedPrompt, committed_length: int):
    """(the recorded step whose block extends ``committed_length`` or covers it in its accepted part, the offset
    of ``committed_length`` in that block), or (None, 0)."""
    for step in p.steps:
        offset = committed_length - step.committed_length
        if offset == 0 or 0 < offset <= step.num_accepted:  # past its last draft token: an empty block
            return step, offset
    return None, 0


async def _exchange(call, msg):
    """Send one block on the Verify stream and read its verdict."""
    await call.write(msg)
    return await call.read()


def tally_metrics(t: ReplayTally) -> dict:
    import numpy as np

    lat = np.array(t.latencies_s) * 1000 if t.latencies_s else None
    return {
        "tokens_per_s": t.steady_tokens_per_s(),
        "verdicts_per_s": t.steady_verdicts_per_s(),
        "tokens_per_verdict": safe_ratio(t.tokens, t.verdicts),
        "tokens_per_s_window": safe_ratio(t.tokens, t.window_s),
        "mean_batch_size": safe_ratio(t.batch_size_sum, t.verdicts),
        "verify_latency_ms": {
            "p50": round(float(np.percentile(lat, 50)), 2) if lat is not None else None,
            "p99": round(float(np.percentile(lat, 99)), 2) if lat is not None else None,
        },
        "errors": t.errors,
        "mismatches": t.mismatches,
        "sessions_started": t.sessions_started,
        "sessions_completed": t.sessions_completed,
        "num_tokens": t.tokens,
        "num_verdicts": t.verdicts,
        "verified_positions_per_token": safe_ratio(t.verified_positions, t.tokens),
        "mean_verified_positions": safe_ratio(t.verified_positions, t.verdicts),
        "window_s": t.window_s,
        "ramp_s": round(t.ramp_s, 2),
        **({"ramp_timed_out": True} if t.ramp_timed_out else {}),
        "drain_s": round(t.drain_s, 2),
        **({"error_samples": t.error_samples} if t.error_samples else {}),
        **({"mismatch_samples": t.mismatch_samples} if t.mismatch_samples else {}),
    }
