"""Property-based fuzzing over the wire (hypothesis) against a real verifier server on 127.0.0.1.

The server: an EmbeddedServer around the real Verifier (tiny random Llama pair of conftest), with API keys of two
tenants (plaintext on loopback). Three fuzzers, each a bounded number of cases within one time budget:

1. random OpenSession requests (any prompt ids, sampling and stopping values, fingerprints, tenants);
2. random DraftBlock sequences against live sessions (session ids, seq numbers, committed lengths, token ids,
   top-k draft distributions — valid and broken), over VerifyBlock and the Verify stream;
3. random interleavings (a hypothesis state machine) of opens, valid and invalid blocks, multi-session Verify
   streams, cancellations (stream and unary), closes, other tenants' calls and calls without a key.

Properties: the server never crashes and keeps serving; it answers only the documented status codes (never
INTERNAL/UNKNOWN); a call that fails leaves the session's committed tokens unchanged (read back with
GetSession); committed tokens of greedy sessions are always the target's own greedy continuation (lossless);
token ids are always in the vocabulary; other tenants' sessions are invisible; and a "witness" session that
decodes in a background thread the whole time gives token-identical output to its solo run, every time.

Counts of cases and interleavings are printed at the end (``test_zz_fuzz_summary``). Deterministic by default
(``derandomize``); ``SPECDEC_FUZZ_RANDOM=1`` draws new cases, ``SPECDEC_FUZZ_SCALE=N`` multiplies the case counts.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from _reference import hf_greedy
from specdec_runtime.cloud_verifier.security.auth import ApiKeyStore, append_api_key
from specdec_runtime.cloud_verifier.security.transport import ServerSecurity
from specdec_runtime.cloud_verifier.store import MemorySessionStore
from specdec.embedded import EmbeddedServer
from specdec_runtime.common.v1 import verifier_pb2 as pb
from specdec_runtime.common.v1 import verifier_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WAIT_S = 30.0
MAX_BLOCK = 4
VOCAB = 49152  # the tiny pair's vocabulary (= the SmolLM2 tokenizer's)
CONTEXT = 512  # the tiny target's max_position_embeddings
TIME_BUDGET_S = float(os.environ.get("SPECDEC_FUZZ_BUDGET_S", "80"))  # all fuzzers together
SCALE = float(os.environ.get("SPECDEC_FUZZ_SCALE", "1"))
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED}
PROMPTS = [[1, 504, 3458, 28], [1, 9690, 198, 2683, 314, 260], [7, 7, 7], [1, 3458, 11, 905, 77, 11, 905]]
REF_TOKENS = 40  # greedy reference length per prompt

COUNTS: dict[str, int] = {"open_cases": 0, "block_cases": 0, "blocks_sent": 0, "machine_runs": 0,
                          "machine_steps": 0, "stream_bursts": 0, "cancellations": 0, "witness_runs": 0,
                          "skipped_over_budget": 0}
CODES: dict[str, int] = {}
T0 = [None]


def _settings(n: int, **kw) -> settings:
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None,
                    derandomize=os.environ.get("SPECDEC_FUZZ_RANDOM") != "1",
                    suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink],
                    print_blob=True, **kw)


def _over_budget() -> bool:
    if T0[0] is None:
        T0[0] = time.monotonic()
    if time.monotonic() - T0[0] > TIME_BUDGET_S:
        COUNTS["skipped_over_budget"] += 1
        return True
    return False


def _count(code: grpc.StatusCode) -> None:
    CODES[code.name] = CODES.get(code.name, 0) + 1


# ---------------------------------------------------------------------------------------------- the server


@dataclass
class Fuzzed:
    address: str
    verifier: object
    keys: dict
    stubs: dict  # tenant ("" = no key) -> (stub, metadata)
    refs: dict  # tuple(prompt) -> greedy reference tokens
    channel: grpc.Channel
    witness_errors: list = field(default_factory=list)
    solo_done: threading.Event = field(default_factory=threading.Event)  # the witness's solo run is made

    def call(self, tenant: str, method: str, request, **kw):
        stub, md = self.stubs[tenant]
        return getattr(stub, method)(request, timeout=WAIT_S, metadata=md, **kw)

    def committed(self, tenant: str, sid: str) -> list[int]:
        return list(self.call(tenant, "GetSession", pb.GetSessionRequest(session_id=sid)).committed_token_ids)


@pytest.fixture(scope="module")
def fuzz(tiny_pair, tmp_path_factory):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    path = tmp_path_factory.mktemp("fuzz-keys") / "keys"
    keys = {t: append_api_key(path, t) for t in ("acme", "globex")}
    runner = TargetRunner(Path(tiny_pair.target_dir), kv_cache_budget_tokens=65536)
    verifier = Verifier(runner, MemorySessionStore(ttl_s=300), verifier_id="fuzz", max_num_speculative_tokens=MAX_BLOCK,
                        max_sessions=48, max_batch_wait_ms=1.0)
    embedded = EmbeddedServer(verifier=verifier, grace_s=1.0, security=ServerSecurity(None, ApiKeyStore(path)))
    address = embedded.start(timeout_s=WAIT_S)
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.VerifierStub(channel)
    stubs = {"": (stub, ())}
    for t, k in keys.items():
        stubs[t] = (stub, (("authorization", f"Bearer {k}"),))
    refs = {tuple(p): hf_greedy(tiny_pair.target_dir, p, REF_TOKENS) for p in PROMPTS}
    fz = Fuzzed(address, verifier, keys, stubs, refs, channel)
    stop = threading.Event()
    witness = threading.Thread(target=_witness, args=(fz, tiny_pair, stop), daemon=True)
    witness.start()
    assert fz.solo_done.wait(120), fz.witness_errors  # the solo run happens before any fuzzing
    yield fz
    stop.set()
    witness.join(timeout=120)
    channel.close()
    embedded.stop(timeout_s=WAIT_S)
    assert not fz.witness_errors, fz.witness_errors[:3]


def _witness(fz: Fuzzed, tiny_pair, stop: threading.Event) -> None:
    """Decode the same prompt over and over (its own channel, tenant acme) while the fuzzers run; every output
    must equal the solo run made before any fuzzing."""
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    try:
        model = OnnxDraftModel(tiny_pair.draft_dir)
        with EdgeClient(GrpcBackend(fz.address, api_key=fz.keys["acme"]), ModelDrafter(model), model.tokenizer,
                        num_speculative_tokens=MAX_BLOCK) as client:
            solo = client.generate("A witness that must not notice the fuzzing.", max_new_tokens=32,
                                   ignore_eos=True).token_ids
            fz.solo_done.set()
            while not stop.is_set():
                out = client.generate("A witness that must not notice the fuzzing.", max_new_tokens=32,
                                      ignore_eos=True).token_ids
                COUNTS["witness_runs"] += 1
                if out != solo:
                    fz.witness_errors.append(f"witness output changed: {out} != {solo}")
    except Exception as e:  # noqa: BLE001 - reported by the fixture
        fz.witness_errors.append(f"witness failed: {type(e).__name__}: {e}")
    finally:
        fz.solo_done.set()


def _check_error(e: grpc.RpcError) -> grpc.StatusCode:
    code = e.code()
    _count(code)
    assert code in ALLOWED, f"undocumented status {code.name}: {e.details()}"
    return code


# ---------------------------------------------------------------------------------------------- strategies

int32 = st.integers(-(2**31), 2**31 - 1)
token_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 600), int32, st.sampled_from([-1, VOCAB, VOCAB + 5]))
weird_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                        st.sampled_from([0.0, 1e-40, 1e-31, 1e-30, 0.5, 1.0, 2.0, -1.0]))


@st.composite
def open_requests(draw):
    prompt = draw(st.one_of(st.lists(token_id, max_size=24), st.sampled_from(PROMPTS),
                            st.just([1] * (CONTEXT + 3)), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)))
    sampling = pb.SamplingParams(temperature=draw(weird_float), top_k=draw(int32), top_p=draw(weird_float),
                                 seed=draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
                                 has_seed=draw(st.booleans()))
    stopping = pb.StoppingCriteria(
        max_new_tokens=draw(st.one_of(st.integers(-3, 40), int32)),
        stop_token_ids=draw(st.lists(int32, max_size=3)),
        stop_strings=draw(st.lists(st.text(max_size=6), max_size=2)),
        ignore_eos=draw(st.booleans()))
    req = pb.OpenSessionRequest(prompt_token_ids=prompt, tokenizer_fingerprint=draw(st.sampled_from(["", "bogus"])),
                                client_id=draw(st.text(max_size=8)))
    if draw(st.booleans()):
        req.sampling.CopyFrom(sampling)
    if draw(st.booleans()):
        req.stopping.CopyFrom(stopping)
    return draw(st.sampled_from(["acme", "globex", ""])), req


def test_fuzz_open_session(fuzz):
    @_settings(150)
    @given(case=open_requests())
    def run(case):
        if _over_budget():
            return
        tenant, req = case
        COUNTS["open_cases"] += 1
        try:
            opened = fuzz.call(tenant, "OpenSession", req)
        except grpc.RpcError as e:
            code = _check_error(e)
            assert tenant or code == grpc.StatusCode.UNAUTHENTICATED
            return
        _count(grpc.StatusCode.OK)
        prompt = list(req.prompt_token_ids)
        assert tenant, "opened without a key"
        assert opened.committed_length == len(prompt) and len(opened.session_id) == 24
        assert all(0 <= t < VOCAB for t in prompt) and 0 < len(prompt) < CONTEXT
        assert fuzz.committed(tenant, opened.session_id) == prompt
        other = "globex" if tenant == "acme" else "acme"
        try:
            fuzz.committed(other, opened.session_id)
            raise AssertionError("another tenant read the session")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND
        assert fuzz.call(tenant, "CloseSession", pb.CloseSessionRequest(session_id=opened.session_id)).existed

    run()


# ---------------------------------------------------------------------------------------------- blocks


@dataclass
class Sess:
    sid: str
    tenant: str
    prompt: list[int]
    ref: list[int] | None  # greedy reference continuation (None: sampled session)
    committed: list[int]
    last_seq: int = 0
    max_new: int = 32
    open: bool = True

    @property
    def capacity(self) -> int:
        return min(CONTEXT, len(self.prompt) + self.max_new)


def _open(fuzz: Fuzzed, tenant: str, prompt: list[int], temperature: float, max_new: int, seed: int = 1) -> Sess:
    req = pb.OpenSessionRequest(prompt_token_ids=prompt,
                                sampling=pb.SamplingParams(temperature=temperature, seed=seed, has_seed=True),
                                stopping=pb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True))
    opened = fuzz.call(tenant, "OpenSession", req)
    ref = fuzz.refs[tuple(prompt)] if temperature == 0.0 else None
    return Sess(opened.session_id, tenant, list(prompt), ref, list(prompt), max_new=max_new)


def _check_lossless(s: Sess, committed: list[int]) -> None:
    assert committed[: len(s.prompt)] == s.prompt
    assert all(0 <= t < VOCAB for t in committed)
    assert len(committed) <= s.capacity
    if s.ref is not None:
        out = committed[len(s.prompt):]
        assert out == s.ref[: len(out)], "greedy output is not the target's"


def _pick(draw, items: list):
    """One of ``items``, drawn with constraints that do not depend on how many there are (server state can
    change them between runs: hypothesis needs the same draws to mean the same thing)."""
    return items[draw(st.integers(0, 255)) % len(items)]


@st.composite
def draft_blocks(draw, s: Sess):
    """(block, fault): a block for session ``s`` — mostly plausible, often broken in one way. Every draw has
    fixed constraints; the session's state only maps the drawn values (see :func:`_pick`)."""
    pos = len(s.committed)
    room = max(0, min(MAX_BLOCK, s.capacity - pos))
    overlong = draw(st.integers(0, 9)) == 0
    raw_gamma = draw(st.integers(0, MAX_BLOCK + 2))
    gamma = min(raw_gamma, room + 1) if overlong else raw_gamma % (room + 1)
    use_ref = draw(st.booleans())
    j = draw(st.integers(0, MAX_BLOCK + 2))
    pool = draw(st.lists(st.integers(0, VOCAB - 1), min_size=MAX_BLOCK + 2, max_size=MAX_BLOCK + 2))
    if s.ref is not None and use_ref:
        start = pos - len(s.prompt)
        good = s.ref[start: start + gamma]
        j = min(j, len(good))
        ids = good[:j] + pool[: gamma - j]
    else:
        ids = pool[:gamma]
    fault = draw(st.sampled_from(["none"] * 6 + ["seq", "length", "id", "sid", "probs", "probs_shape",
                                                  "probs_nan", "probs_missing", "big_seq"]))
    seq_step, seq_back = draw(st.integers(1, 3)), draw(st.integers(0, 2**16))
    length_delta = draw(st.sampled_from([-1, 1, -pos, 10**6, -(2**31)]))
    id_index, bad_id = draw(st.integers(0, 255)), draw(st.sampled_from([-1, VOCAB, 2**31 - 1, -(2**31)]))
    bad_sid = draw(st.sampled_from(["", "0" * 24, s.sid[:-1], s.sid + "0", "../../etc/passwd"]))
    seq, length, sid = s.last_seq + seq_step, pos, s.sid
    if fault == "seq":
        seq = seq_back % (s.last_seq + 1)
    elif fault == "big_seq":
        seq = 2**64 - 1
    elif fault == "length":
        length = pos + length_delta
    elif fault == "id" and ids:
        ids[id_index % len(ids)] = bad_id
    elif fault == "sid":
        sid = bad_sid
    seq, length = min(seq, 2**64 - 1), max(-(2**31), min(length, 2**31 - 1))  # uint64 / int32 on the wire
    msg = pb.DraftBlock(session_id=sid, seq=seq, committed_length=length, draft_token_ids=ids,
                        draft_ms=draw(weird_float))
    top_k = draw(st.booleans()) or fault.startswith("probs")
    rows = []
    for _ in range(MAX_BLOCK + 2):  # drawn for the longest block, used for the first len(ids) draft tokens
        k = draw(st.integers(1, 6))
        others = draw(st.lists(st.integers(0, VOCAB - 1), min_size=6, max_size=6, unique=True))
        weights = draw(st.lists(st.floats(0.01, 1.0), min_size=6, max_size=6))
        rows.append((k, others, weights))
    if top_k and ids:
        for x, (k, others, weights) in zip(ids, rows):
            row_ids = list(dict.fromkeys([x, *others]))[:k]
            p = np.array(weights[: len(row_ids)])
            p = (p / p.sum()).astype(np.float32)
            if fault == "probs_missing":
                row_ids = [t for t in row_ids if t != x] or [(x + 1) % VOCAB]
                p = np.full(len(row_ids), 1.0 / len(row_ids), dtype=np.float32)
            if fault == "probs_nan":
                p[0] = np.nan
            if fault == "probs":
                p = p * 3
            msg.draft_probs.add(token_ids=row_ids, probs=p.tolist())
        if fault == "probs_shape":
            msg.draft_probs.add(token_ids=[1], probs=[1.0])
    return msg, fault


def _apply(fuzz: Fuzzed, s: Sess, msg: pb.DraftBlock, verdict: pb.Verdict) -> None:
    """Update the model with a verdict and check it against GetSession."""
    ids = list(msg.draft_token_ids)
    n = verdict.num_accepted
    new = ids[:n] + ([verdict.next_token_id] if verdict.next_token_id >= 0 else [])
    grown = verdict.committed_length - len(s.committed)
    assert 0 <= grown <= len(new) and grown >= 1 or verdict.finished
    s.committed = s.committed + new[:grown]
    s.last_seq = msg.seq
    _check_lossless(s, s.committed)


def _send_one(fuzz: Fuzzed, s: Sess, msg: pb.DraftBlock, via_stream: bool, tenant: str | None = None) -> None:
    tenant = s.tenant if tenant is None else tenant
    before = fuzz.committed(s.tenant, s.sid)
    assert before == s.committed
    COUNTS["blocks_sent"] += 1
    try:
        if via_stream:
            verdicts = list(fuzz.call(tenant, "Verify", iter([msg])))
            assert len(verdicts) == 1
            verdict = verdicts[0]
        else:
            verdict = fuzz.call(tenant, "VerifyBlock", msg)
    except grpc.RpcError as e:
        _check_error(e)
        assert fuzz.committed(s.tenant, s.sid) == before, "an error changed the committed tokens"
        return
    _count(grpc.StatusCode.OK)
    assert tenant == s.tenant and msg.session_id == s.sid
    assert verdict.seq == msg.seq
    _apply(fuzz, s, msg, verdict)
    assert fuzz.committed(s.tenant, s.sid) == s.committed


def test_fuzz_draft_blocks(fuzz):
    @_settings(120)
    @given(data=st.data())
    def run(data):
        if _over_budget():
            return
        COUNTS["block_cases"] += 1
        prompt = data.draw(st.sampled_from(PROMPTS))
        temperature = data.draw(st.sampled_from([0.0, 0.0, 0.7, 1.5]))
        s = _open(fuzz, data.draw(st.sampled_from(["acme", "globex"])), prompt, temperature,
                  data.draw(st.integers(1, 24)), seed=data.draw(st.integers(0, 2**32)))
        try:
            for _ in range(data.draw(st.integers(1, 6))):
                msg, _fault = data.draw(draft_blocks(s))
                via_stream = data.draw(st.booleans())
                who = data.draw(st.integers(0, 9))
                tenant = s.tenant if who < 8 else "" if who == 8 else ("globex" if s.tenant == "acme" else "acme")
                _send_one(fuzz, s, msg, via_stream, tenant)
        finally:
            fuzz.call(s.tenant, "CloseSession", pb.CloseSessionRequest(session_id=s.sid))

    run()


# ---------------------------------------------------------------------------------------------- interleavings


class Interleavings(RuleBasedStateMachine):
    """Random interleavings of sessions, sequence numbers, streams, cancellations and closes."""

    fuzz: Fuzzed = None  # set by the test

    def __init__(self):
        super().__init__()
        self.sessions: list[Sess] = []
        COUNTS["machine_runs"] += 1

    def teardown(self):
        for s in self.sessions:
            if s.open:
                try:
                    self.fuzz.call(s.tenant, "CloseSession", pb.CloseSessionRequest(session_id=s.sid))
                except grpc.RpcError:
                    pass

    def _live(self):
        return [s for s in self.sessions if s.open]

    def _resync(self, s: Sess, seq_if_committed: int) -> None:
        """After a cancelled or unanswered block (seq ``seq_if_committed``): wait until the session's committed
        tokens stop moving, then adopt them (unchanged, or that one block committed wholly)."""
        last, deadline = None, time.monotonic() + 5.0
        while time.monotonic() < deadline:
            now = self.fuzz.committed(s.tenant, s.sid)
            if now == last:
                break
            last = now
            time.sleep(0.03)
        assert last[: len(s.committed)] == s.committed and len(last) - len(s.committed) <= MAX_BLOCK + 1
        _check_lossless(s, last)
        if len(last) > len(s.committed):
            s.last_seq = seq_if_committed  # the block was committed (wholly)
        s.committed = last

    @rule(prompt=st.sampled_from(PROMPTS), temperature=st.sampled_from([0.0, 0.0, 0.9]),
          tenant=st.sampled_from(["acme", "globex"]), max_new=st.integers(1, 30))
    def open_session(self, prompt, temperature, tenant, max_new):
        COUNTS["machine_steps"] += 1
        if len(self._live()) >= 6:
            return
        self.sessions.append(_open(self.fuzz, tenant, prompt, temperature, max_new))

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def block(self, data):
        COUNTS["machine_steps"] += 1
        s = _pick(data.draw, self._live())
        msg, _ = data.draw(draft_blocks(s))
        _send_one(self.fuzz, s, msg, data.draw(st.booleans()))

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def stream_burst(self, data):
        """Several blocks of several sessions on one Verify stream, maybe one broken: the verdicts of the blocks
        before the first failure come back in order; every session stays lossless; the failing block's session
        is exactly where its answered blocks left it."""
        COUNTS["machine_steps"] += 1
        COUNTS["stream_bursts"] += 1
        live = self._live()
        picks = data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=4))
        chosen = list({id(s): s for s in (live[i % len(live)] for i in picks)}.values())
        tenant = data.draw(st.sampled_from(["acme", "globex"]))
        msgs, owners = [], []
        for s in chosen:
            msg, _ = data.draw(draft_blocks(s))
            msgs.append(msg)
            owners.append(s)
        COUNTS["blocks_sent"] += len(msgs)
        verdicts, error = [], None
        try:
            for v in self.fuzz.call(tenant, "Verify", iter(msgs)):
                verdicts.append(v)
        except grpc.RpcError as e:
            error = e
            _check_error(e)
        assert len(verdicts) <= len(msgs)
        for msg, s, v in zip(msgs, owners, verdicts):
            assert v.seq == msg.seq and s.tenant == tenant
            _count(grpc.StatusCode.OK)
            _apply(self.fuzz, s, msg, v)
        if error is None:
            assert len(verdicts) == len(msgs)
        # unanswered blocks (the failing one, or later ones of other sessions that may still have been verified:
        # cloud_verifier/serving/server.py): the store is the truth; the failing block's own session must not have moved
        failed_owner = owners[len(verdicts)] if error is not None else None
        for msg, s in zip(msgs[len(verdicts):], owners[len(verdicts):]):
            committed = self.fuzz.committed(s.tenant, s.sid)
            if s is failed_owner:
                assert committed == s.committed, "the failing block changed its session"
            else:
                self._resync(s, msg.seq)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), delay_ms=st.sampled_from([0, 0, 1, 3]), unary=st.booleans())
    def cancel(self, data, delay_ms, unary):
        """Send a block and cancel the call: nothing half-committed (unchanged, or the whole verdict)."""
        COUNTS["machine_steps"] += 1
        COUNTS["cancellations"] += 1
        s = _pick(data.draw, self._live())
        msg, _ = data.draw(draft_blocks(s))
        msg.seq = min(s.last_seq + 1, 2**64 - 1)
        stub, md = self.fuzz.stubs[s.tenant]
        release = threading.Event()
        if unary:
            call = stub.VerifyBlock.future(msg, timeout=WAIT_S, metadata=md)
        else:
            def requests():
                yield msg
                release.wait(WAIT_S)

            call = stub.Verify(requests(), timeout=WAIT_S, metadata=md)
        time.sleep(delay_ms / 1000)
        call.cancel()
        release.set()
        self._resync(s, msg.seq)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), own=st.booleans())
    def close(self, data, own):
        COUNTS["machine_steps"] += 1
        s = _pick(data.draw, self._live())
        tenant = s.tenant if own else ("globex" if s.tenant == "acme" else "acme")
        existed = self.fuzz.call(tenant, "CloseSession", pb.CloseSessionRequest(session_id=s.sid)).existed
        if own:
            assert existed
            s.open = False
            try:
                self.fuzz.committed(s.tenant, s.sid)
                raise AssertionError("a closed session is still readable")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND
        else:
            assert not existed  # another tenant: answered as unknown, left alone

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def intruder(self, data):
        """Another tenant or no key at all: NOT_FOUND / UNAUTHENTICATED, nothing changes."""
        COUNTS["machine_steps"] += 1
        s = _pick(data.draw, self._live())
        tenant = "" if data.draw(st.booleans()) else ("globex" if s.tenant == "acme" else "acme")
        want = grpc.StatusCode.UNAUTHENTICATED if tenant == "" else grpc.StatusCode.NOT_FOUND
        for method, req in (("GetSession", pb.GetSessionRequest(session_id=s.sid)),
                            ("VerifyBlock", pb.DraftBlock(session_id=s.sid, seq=min(s.last_seq + 1, 2**64 - 1),
                                                          committed_length=len(s.committed), draft_token_ids=[5]))):
            try:
                self.fuzz.call(tenant, method, req)
                raise AssertionError(f"{method} by an intruder succeeded")
            except grpc.RpcError as e:
                assert e.code() == want, (method, e.code(), e.details())

    @invariant()
    def committed_match_the_store(self):
        for s in self._live():
            assert self.fuzz.committed(s.tenant, s.sid) == s.committed


def test_fuzz_interleavings(fuzz):
    Interleavings.fuzz = fuzz
    if _over_budget():
        return
    run_state_machine_as_test(Interleavings, settings=_settings(40, stateful_step_count=15))


def test_zz_fuzz_summary(fuzz, capsys):
    """The server still serves after everything; the counts for the closing note."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    status = health_pb2_grpc.HealthStub(fuzz.channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                            timeout=WAIT_S).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    s = _open(fuzz, "acme", PROMPTS[0], 0.0, 4)
    fuzz.call("acme", "CloseSession", pb.CloseSessionRequest(session_id=s.sid))
    elapsed = time.monotonic() - (T0[0] or time.monotonic())
    with capsys.disabled():
        print(f"\nfuzz summary ({elapsed:.1f} s): " + ", ".join(f"{k}={v}" for k, v in COUNTS.items())
              + "; status codes: " + ", ".join(f"{k}={v}" for k, v in sorted(CODES.items())))
    assert COUNTS["open_cases"] + COUNTS["block_cases"] + COUNTS["machine_runs"] >= 100
    assert "INTERNAL" not in CODES and "UNKNOWN" not in CODES
