"""The verifier under load stays correct: real grpc.aio server on loopback around the real Verifier (tiny random
Llama pair of conftest), real clients.

- Backpressure: a client that sends blocks for 256 sessions on one Verify stream and never reads its verdicts
  stalls neither the batcher nor another client's session, and the server holds a bounded amount of memory for
  it (the stream's read-ahead window, not every block the client tried to send).
- No cross-talk: 32 concurrent sessions (mixed γ and drafters, greedy and seeded sampling, four streams shared
  by eight sessions each), each asked to repeat its own marker word: every output equals its solo run and no
  marker shows up in another session's output.
- Metrics are exact: the spec_decode counters move by exactly the sums of the clients' verdicts, and not at all
  while the verifier idles.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client import REGISTRY

from specdec_runtime.cloud_verifier.serving.server import STREAM_WINDOW
from specdec_runtime.cloud_verifier.store import MemorySessionStore
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.types import SamplingParams, StoppingCriteria
from specdec_runtime.common.wire import open_request_to_proto
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from specdec_runtime.edge_client.drafting.ngram import NgramDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import EmbeddedServer
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WAIT_S = 60.0  # bound of every wait, s


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=1 << 18)


def _server(runner, **kw) -> tuple[EmbeddedServer, Verifier, str]:
    kw.setdefault("max_batch_wait_ms", 2.0)
    verifier = Verifier(runner, MemorySessionStore(ttl_s=300), verifier_id="load-test", **kw)
    server = EmbeddedServer(verifier=verifier, grace_s=2.0)
    return server, verifier, server.start(timeout_s=WAIT_S)


def _counter(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


# ---------------------------------------------------------------------------------------------- backpressure

STUCK_SESSIONS = 256
STUCK_PROMPT = [5, 6, 7]
STUCK_MAX_NEW_TOKENS = 400  # the tiny model's context is 512
STUCK_ROUNDS = 60  # empty blocks per stuck session first: more verdicts than the client's receive window holds
WRITE_STALL_S = 3.0  # a write that does not complete within this long: the server pushes back
BIG_BLOCK_TOP_K = 1000  # then top-k blocks of ~94 KB each, so that flow-control windows fill within seconds
MAX_BIG_BLOCKS = 600  # ~56 MB: what the stuck client tries to push at most
SENT_BOUND_BYTES = 16 << 20  # HTTP/2 windows (gRPC's BDP estimator grows a stream's to a few MiB) + socket buffers
GOOD_PROMPT = [11, 12, 13, 14, 15, 16]
# The stuck client's receive window stays at HTTP/2's initial 64 KiB (no BDP probing, which would grow it to
# megabytes): verdicts it does not read fill it after a few thousand, within seconds.
STUCK_CHANNEL_OPTIONS = [("grpc.http2.bdp_probe", 0)]


class _StuckClient:
    """A raw grpc.aio client in a thread of its own: opens STUCK_SESSIONS sessions, then on ONE Verify stream
    writes STUCK_ROUNDS rounds of empty blocks (plain decoding: each commits exactly one token, so block k of a
    session extends prompt + k - 1 tokens without any verdict read), then large top-k blocks, and never reads a
    verdict. Records the bytes it got accepted before a write stalled."""

    def __init__(self, address: str):
        self.address = address
        self.session_ids: list[str] = []
        self.sent_blocks = 0
        self.sent_bytes = 0
        self.opened = threading.Event()
        self.blocked = threading.Event()  # a write stalled: backpressure reached the client
        self.release = threading.Event()  # the test is done with it: cancel the stream
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="stuck-client", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
            self.opened.set()
            self.blocked.set()

    def _blocks(self):
        for seq in range(1, STUCK_ROUNDS + 1):
            for sid in self.session_ids:
                yield pb.DraftBlock(session_id=sid, seq=seq, committed_length=len(STUCK_PROMPT) + seq - 1)
        row = pb.SparseDistribution(token_ids=list(range(BIG_BLOCK_TOP_K)), probs=[1.0 / BIG_BLOCK_TOP_K] * BIG_BLOCK_TOP_K)
        for i in range(MAX_BIG_BLOCKS):
            sid = self.session_ids[i % len(self.session_ids)]
            yield pb.DraftBlock(session_id=sid, seq=STUCK_ROUNDS + 1 + i // len(self.session_ids),
                                committed_length=len(STUCK_PROMPT) + STUCK_ROUNDS, draft_token_ids=[1] * 16,
                                draft_probs=[row] * 16)

    async def _main(self) -> None:
        async with grpc.aio.insecure_channel(self.address, options=STUCK_CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.VerifierStub(channel)
            request = open_request_to_proto(STUCK_PROMPT, SamplingParams(),
                                            StoppingCriteria(max_new_tokens=STUCK_MAX_NEW_TOKENS, ignore_eos=True))
            opened = await asyncio.gather(*(stub.OpenSession(request, timeout=WAIT_S)
                                            for _ in range(STUCK_SESSIONS)))
            self.session_ids = [o.session_id for o in opened]
            self.opened.set()
            call = stub.Verify()
            loop = asyncio.get_running_loop()
            for block in self._blocks():
                write = asyncio.ensure_future(call.write(block))
                done, _ = await asyncio.wait({write}, timeout=WRITE_STALL_S)
                if not done:  # the server stopped taking blocks: stay stuck until the test releases us
                    self.blocked.set()
                    await loop.run_in_executor(None, self.release.wait, WAIT_S * 4)
                    break
                write.result()
                self.sent_blocks += 1
                self.sent_bytes += block.ByteSize()
            call.cancel()


def test_a_client_that_never_reads_its_verdicts_stalls_nothing(tiny_pair, runner):
    server, verifier, address = _server(runner, max_sessions=STUCK_SESSIONS + 8, max_batch_size=32)
    model = OnnxDraftModel(tiny_pair.draft_dir)
    good = EdgeClient(GrpcBackend(address), ModelDrafter(model), model.tokenizer, num_speculative_tokens=3)
    stuck = _StuckClient(address)
    tracing = False
    try:
        solo = good.generate(GOOD_PROMPT, max_new_tokens=40, ignore_eos=True).token_ids
        stuck.thread.start()
        assert stuck.opened.wait(WAIT_S) and stuck.error is None, stuck.error
        assert verifier.num_sessions == STUCK_SESSIONS
        gc.collect()
        tracemalloc.start()
        tracing = True
        base = tracemalloc.get_traced_memory()[0]
        drafts_before = _counter("specdec_spec_decode_num_drafts_total")

        # end-to-end backpressure: the client's writes stall after a bounded number of bytes
        assert stuck.blocked.wait(WAIT_S * 2) and stuck.error is None, stuck.error
        assert stuck.sent_blocks > STUCK_SESSIONS * STUCK_ROUNDS  # it got past the empty blocks
        assert stuck.sent_bytes < SENT_BOUND_BYTES, f"{stuck.sent_bytes} bytes taken before pushing back"
        # the server works off what it took, then stops verifying the stuck stream's blocks: it waits for the
        # client to read its verdicts (before running out of valid blocks to verify)
        verified, deadline = -1.0, time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            now = _counter("specdec_spec_decode_num_drafts_total") - drafts_before
            if now == verified:
                break
            verified = now
            time.sleep(1.0)
        assert 0 < verified < STUCK_SESSIONS * STUCK_ROUNDS, verified
        time.sleep(1.0)
        assert _counter("specdec_spec_decode_num_drafts_total") - drafts_before == verified

        # ... and everything else goes on: another client's session runs, with its solo output (a bounded wait
        # for it, not a wall-clock bound on how fast a loaded machine runs 40 tokens)
        with ThreadPoolExecutor(1) as pool:
            res = pool.submit(good.generate, GOOD_PROMPT, max_new_tokens=40, ignore_eos=True).result(WAIT_S)
        assert res.token_ids == solo

        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        tracing = False
        # Python memory bound, from sizes: the stream's read-ahead (STREAM_WINDOW block tasks + one being read),
        # one batch of work items, and per verified block its committed token (session copy, store copy, stopping
        # state); 8 KiB per task and 512 B per verified block are a few times their sizes (measured here: ~0.8 MiB
        # in all for ~2,700 verdicts). A server holding every block the client sent (~15,000, ~6 MB) as a task
        # would need tens of MiB.
        bound = (STREAM_WINDOW + 2 + 32) * 8 * 1024 + int(verified) * 512 + 2**20
        assert peak - base < bound, f"peak +{(peak - base) >> 10} KiB > {bound >> 10} KiB"
        assert current - base < bound
    finally:
        if tracing:
            tracemalloc.stop()
        stuck.release.set()
        stuck.thread.join(WAIT_S)
        for sid in stuck.session_ids:
            verifier.close_session(sid)
        good.close()
        deadline = time.monotonic() + WAIT_S
        while runner.kv_reserved_tokens and time.monotonic() < deadline:  # blocks in flight free theirs when done
            time.sleep(0.05)
        server.stop(timeout_s=WAIT_S)
    assert runner.kv_reserved_tokens == 0


def test_a_long_lived_stream_keeps_nothing_per_finished_session(tiny_pair, runner):
    """One GrpcBackend (one Verify stream) carries many sessions one after the other; once they are over, the
    server holds no block task of theirs (it used to keep the last one of every session the stream had seen,
    with its verdict: a stream living for hours grew without bound)."""
    server, verifier, address = _server(runner)
    model = OnnxDraftModel(tiny_pair.draft_dir)
    client = EdgeClient(GrpcBackend(address), ModelDrafter(model), model.tokenizer, num_speculative_tokens=2)
    try:
        for i in range(40):
            client.generate([20 + i, 21, 22], max_new_tokens=3, ignore_eos=True)

        def block_tasks() -> int:
            gc.collect()
            return sum(1 for o in gc.get_objects() if type(o) is asyncio.Task  # noqa: E721 - no proxy lookups
                       and getattr(o.get_coro(), "__name__", "") == "run_block")

        # the stream handler holds the task of the block it answered last (one per stream); nothing else stays
        deadline = time.monotonic() + 10.0
        while block_tasks() > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert block_tasks() <= 1
    finally:
        client.close()
        server.stop(timeout_s=WAIT_S)


# ---------------------------------------------------------------------------------------------- cross-talk

NUM_SESSIONS = 32
NUM_STREAMS = 4


def _marker(i: int) -> str:
    """A made-up word per session: 'Q' + four letters spelling i in base 26 (distinct, same length)."""
    letters = "".join(chr(ord("a") + (i // 26**k) % 26) for k in range(4))
    return f"Qx{letters}"


def _crosstalk_specs() -> list[dict]:
    specs = []
    for i in range(NUM_SESSIONS):
        m = _marker(i)
        sampled = i % 3 == 2
        specs.append(dict(
            marker=m,
            prompt=f"Repeat the word {m} four times: {m} {m} {m} {m}",
            drafter=("draft", "other", "ngram", "draft")[i % 4],
            gamma=4 + i % 3 if i % 4 == 2 else 1 + i % 6,  # prompt lookup: blocks long enough for a whole marker
            kw=dict(max_new_tokens=16 + i % 9, ignore_eos=True,
                    **(dict(temperature=0.9, top_k=(0, 50)[i % 2], seed=1000 + i) if sampled else {})),
        ))
    return specs


class _RecordingDrafter:
    """Delegates to a drafter and keeps every token it proposed."""

    def __init__(self, inner):
        self.inner = inner
        self.proposed: list[int] = []

    def propose(self, *args, **kwargs):
        block = self.inner.propose(*args, **kwargs)
        self.proposed.extend(block.draft_token_ids)
        return block

    def reset(self) -> None:  # Resettable: a seeded session starts from a fresh draft state
        self.inner.reset()


def _contains(seq: list[int], sub: list[int]) -> bool:
    n = len(sub)
    return any(seq[k : k + n] == sub for k in range(len(seq) - n + 1))


def test_no_cross_talk_between_32_concurrent_sessions(tiny_pair, runner):
    specs = _crosstalk_specs()
    server, verifier, address = _server(runner, max_batch_size=32, max_batch_wait_ms=5.0)
    tokenizer = OnnxDraftModel(tiny_pair.draft_dir).tokenizer
    markers = [tokenizer(" " + s["marker"], add_special_tokens=False)["input_ids"] for s in specs]
    assert len({tuple(m) for m in markers}) == NUM_SESSIONS
    drafters = []
    for s in specs:
        if s["drafter"] == "ngram":
            drafters.append(_RecordingDrafter(NgramDrafter()))
        else:
            model = OnnxDraftModel(tiny_pair.draft_dir if s["drafter"] == "draft" else tiny_pair.other_draft_dir)
            drafters.append(_RecordingDrafter(ModelDrafter(model, draft_top_k=8)))
    backends = [GrpcBackend(address) for _ in range(NUM_STREAMS)]
    batch_sizes: list[int] = []

    class Observed:  # the backend of one client: a shared stream, batch sizes recorded
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def submit(self, *args):
            fut = self.inner.submit(*args)
            fut.add_done_callback(lambda f: f.exception() is None and batch_sizes.append(f.result().batch_size))
            return fut

        def close(self):  # the streams are shared: closed by the test
            pass

    def run(i: int):
        client = EdgeClient(Observed(backends[i % NUM_STREAMS]), drafters[i], tokenizer,
                            num_speculative_tokens=specs[i]["gamma"])
        return client.generate(specs[i]["prompt"], chat=False, **specs[i]["kw"])

    try:
        solo = [run(i) for i in range(NUM_SESSIONS)]  # one at a time
        batch_sizes.clear()
        for d in drafters:
            d.proposed.clear()
        results: list = [None] * NUM_SESSIONS
        errors: list = []
        start = threading.Barrier(NUM_SESSIONS)

        def worker(i: int) -> None:
            try:
                start.wait(WAIT_S)
                results[i] = run(i)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(NUM_SESSIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 3)
        assert not errors, errors[:3]
    finally:
        for b in backends:
            b.close()
        server.stop(timeout_s=WAIT_S)
    assert max(batch_sizes) >= 8, f"the sessions were hardly batched together: {max(batch_sizes)}"
    # the markers were on the wire together: prompt-lookup sessions drafted their own
    ngram_with_marker = sum(_contains(drafters[i].proposed, markers[i]) for i, s in enumerate(specs)
                            if s["drafter"] == "ngram")
    assert ngram_with_marker == sum(s["drafter"] == "ngram" for s in specs)
    for i, (res, ref) in enumerate(zip(results, solo)):
        assert res.token_ids == ref.token_ids, f"session {i} ({specs[i]['drafter']}, γ={specs[i]['gamma']}, " \
                                               f"{specs[i]['kw']}) differs from its solo run"
        for j, m in enumerate(markers):
            if j != i:
                assert not _contains(res.token_ids, m), f"session {j}'s marker in session {i}'s output"
                assert specs[j]["marker"] not in res.text
    assert runner.kv_reserved_tokens == 0


# ---------------------------------------------------------------------------------------------- metrics

_COUNTERS = ("specdec_spec_decode_num_drafts_total", "specdec_spec_decode_num_draft_tokens_total",
             "specdec_spec_decode_num_accepted_tokens_total")
_PER_POS = "specdec_spec_decode_num_accepted_tokens_per_pos_total"


def _snapshot(max_gamma: int) -> dict:
    snap = {n: _counter(n) for n in _COUNTERS}
    snap.update({(_PER_POS, k): _counter(_PER_POS, {"position": str(k)}) for k in range(max_gamma + 1)})
    return snap


def test_spec_decode_counters_equal_the_clients_verdicts(tiny_pair, runner):
    specs = [  # (draft, γ, sampling kwargs): accepting, rejecting, sampled, target-only
        ("draft", 4, {}), ("other", 3, {}), ("draft", 6, dict(temperature=0.8, seed=3)),
        ("other", 5, dict(temperature=1.0, top_p=0.9, seed=4)), (None, 1, {}), ("draft", 2, dict(temperature=0.7, seed=5)),
    ] * 2
    max_gamma = max(g for _, g, _ in specs)
    server, verifier, address = _server(runner, max_batch_size=16, reap_interval_s=0.1)
    backends = [GrpcBackend(address) for _ in range(3)]
    tokenizer = OnnxDraftModel(tiny_pair.draft_dir).tokenizer
    clients = []
    for i, (d, g, _) in enumerate(specs):
        drafter = None if d is None else ModelDrafter(OnnxDraftModel(
            tiny_pair.draft_dir if d == "draft" else tiny_pair.other_draft_dir), draft_top_k=6)
        clients.append(EdgeClient(backends[i % 3], drafter, tokenizer, num_speculative_tokens=g))
    results: list = [None] * len(specs)
    errors: list = []
    try:
        before = _snapshot(max_gamma)

        def worker(i: int) -> None:
            try:
                results[i] = clients[i].generate([30 + i, 31, 32, 33], max_new_tokens=30 + 3 * i, ignore_eos=True,
                                                 **specs[i][2])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(specs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 3)
        assert not errors, errors[:3]
        after = _snapshot(max_gamma)
        time.sleep(1.5)  # idle: the reaper runs ~15 times, nothing is verified
        idle = _snapshot(max_gamma)
        assert runner._forwards_since_trim == 0  # ... and, finding no session, gave freed heap pages back
    finally:
        for b in backends:
            b.close()
        server.stop(timeout_s=WAIT_S)
    stats = [r.stats for r in results]
    assert after["specdec_spec_decode_num_drafts_total"] - before["specdec_spec_decode_num_drafts_total"] == \
        sum(s.num_drafts for s in stats)
    assert after["specdec_spec_decode_num_draft_tokens_total"] - \
        before["specdec_spec_decode_num_draft_tokens_total"] == sum(s.num_draft_tokens for s in stats)
    assert after["specdec_spec_decode_num_accepted_tokens_total"] - \
        before["specdec_spec_decode_num_accepted_tokens_total"] == sum(s.num_accepted_tokens for s in stats)
    for k in range(max_gamma + 1):
        want = sum(s.num_accepted_tokens_per_pos[k] for s in stats if len(s.num_accepted_tokens_per_pos) > k)
        assert after[(_PER_POS, k)] - before[(_PER_POS, k)] == want, f"position {k}"
    assert sum(s.num_accepted_tokens for s in stats) > 0 and sum(s.num_draft_tokens for s in stats) > \
        sum(s.num_accepted_tokens for s in stats)  # both accepting and rejecting drafts ran
    assert idle == after, "counters moved while the verifier was idle"
