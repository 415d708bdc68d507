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
   min(N, 2) sessions: its throughput does not depend on N, and few sessions reach steady state at once.
3. **Kernel limit** (same run, verifiers idle, this process pinned to the verifiers' cores with their thread
   count): N single-row target forwards of γ + 1 tokens vs ONE N-row forward over the same contexts (the
   contexts of recorded sessions half-way through; the KV content does not change the timing, so it is zeros).
   Prefill is left out of it, and on a CPU it does not batch (compute-bound); ``kernel.prefill_share`` adds the
   workload's prefill to both sides: the speedup the kernel allows for this workload.
4. **Memory**: the batched verifier's ``specdec_kv_cache_used_bytes`` (from its /metrics) and VmRSS (from
   /proc/PID/status) when idle before each N, their peak during it, and after it (every session closed).

Every rate is a ratio of sums: committed tokens of verdicts received inside the window / the window. The same
ratios per CPU second of the verifier process (``*_cpu``) take out what other jobs of a shared machine take from
its cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._shared import _progress_bar, _ratio, _resolve_dirs, _target_placement, _threading_config, _versions
from .prompts import BenchPrompt, load_prompts
from .verifier_process import VERIFIER_STARTUP_TIMEOUT_S, _VerifierProcess

REPLAY_FORMAT = 1  # bump when the recording's content or meaning changes (invalidates the cache)
REPLAY_DEFAULT_LIMIT = 16  # prompts recorded when no limit is given (round-robin across categories)
REPLAY_DEFAULT_DURATION_S = 20.0
REPLAY_WARMUP_S = 3.0  # untimed replay on each verifier process before its first timed run
KERNEL_REPEATS = 3
# Sessions driving the one-block-per-forward verifier: its throughput does not depend on N (one block per
# forward pass whatever is queued), two keep it busy during round trips, and a small N reaches steady state
# at once (N sessions opening together put N prefills in its FIFO queue before any block).
SERIAL_CLIENTS = 2
RSS_IDLE_TOLERANCE = 0.05  # RSS counts as back to idle within 5 % (or 16 MiB) of the idle value
RSS_IDLE_TOLERANCE_BYTES = 16 << 20


# ---------------------------------------------------------------------------------------------- the recording


@dataclass
class RecordedStep:
    """One block an edge client sent and the verdict it got."""

    seq: int
    committed_length: int  # tokens the block extends
    draft_token_ids: list[int]
    num_accepted: int
    next_token_id: int
    verdict_committed_length: int
    finished: bool

    def expected(self) -> tuple[int, int, int, bool]:
        return self.num_accepted, self.next_token_id, self.verdict_committed_length, self.finished


@dataclass
class RecordedPrompt:
    question_id: Any
    category: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    steps: list[RecordedStep]

    def committed_before(self, index: int) -> list[int]:
        """Prompt + output tokens committed before step ``index``."""
        cl = self.steps[index].committed_length
        return (self.prompt_token_ids + self.output_token_ids)[:cl]


@dataclass
class Recording:
    key: str
    path: Path
    cached: bool  # loaded from the cache (not recorded in this run)
    max_new_tokens: int
    num_speculative_tokens: int
    tokenizer_fingerprint: str
    prompts: list[RecordedPrompt]
    record_s: float = 0.0

    @property
    def num_steps(self) -> int:
        return sum(len(p.steps) for p in self.prompts)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _model_fingerprint(directory: Path) -> dict:
    """Name, config hash and (size, mtime) of the weight files: changes when the model is re-prepared."""
    d = Path(directory)
    out: dict[str, Any] = {"name": d.name}
    cfg = d / "config.json"
    if cfg.is_file():
        out["config_sha256"] = _file_digest(cfg)[:16]
    for f in sorted(d.iterdir()) if d.is_dir() else []:
        if f.suffix in (".safetensors", ".onnx", ".data", ".bin") or f.name.endswith(".onnx.data"):
            st = f.stat()
            out[f.name] = [st.st_size, st.st_mtime_ns]
    return out


def recording_key(prompts: Path, limit: int, target_dir: Path, draft_dir: Path, *, num_speculative_tokens: int,
                  max_new_tokens: int, device: str, dtype: str) -> str:
    """The cache key of a recording (hex): prompts file hash, limit, model fingerprints, device, dtype, γ,
    max_new_tokens and the recording format."""
    material = {
        "format": REPLAY_FORMAT,
        "prompts_sha256": _file_digest(Path(prompts).expanduser()),
        "limit": limit,
        "target": _model_fingerprint(target_dir),
        "draft": _model_fingerprint(draft_dir),
        "num_speculative_tokens": num_speculative_tokens,
        "max_new_tokens": max_new_tokens,
        "device": device,
        "dtype": dtype,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]


def _replay_cache_dir(cache_dir: Path | None) -> Path:
    from common.paths import default_cache_dir

    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir() / "replay"


class _RecordingBackend:
    """Wraps the in-process backend: records every block sent and the verdict it got, in order."""

    def __init__(self, inner):
        self.inner = inner
        self.steps: list[RecordedStep] = []

    def open_session(self, *args, **kwargs):
        return self.inner.open_session(*args, **kwargs)

    def submit(self, session_id, seq, committed_length, block):
        fut = self.inner.submit(session_id, seq, committed_length, block)
        v = fut.result()  # the client waits for it anyway (no proactive drafting): keeps the order
        self.steps.append(RecordedStep(int(seq), int(committed_length), [int(t) for t in block.draft_token_ids],
                                       int(v.num_accepted), int(v.next_token_id), int(v.committed_length),
                                       bool(v.finished)))
        return fut

    def close_session(self, session_id):
        return self.inner.close_session(session_id)

    def close(self):
        return self.inner.close()

    def take(self) -> list[RecordedStep]:
        out, self.steps = self.steps, []
        return out


def record_blocks(runner, draft_dir: Path, questions: list[BenchPrompt], *, max_new_tokens: int,
                  num_speculative_tokens: int, progress: bool = False) -> tuple[str, list[RecordedPrompt]]:
    """Run a real edge client (ONNX draft, greedy, fixed γ) on every question against an in-process verifier
    over ``runner``; returns (tokenizer fingerprint, recorded prompts)."""
    from cloud_verifier.verifier import Verifier
    from common.vocab import check_vocab_compatible, tokenizer_fingerprint
    from edge_client.client import EdgeClient, encode_prompt
    from edge_client.drafter import ModelDrafter
    from edge_client.onnx_draft import OnnxDraftModel
    from specdec.embedded import LocalBackend

    model = OnnxDraftModel(draft_dir)
    valid = check_vocab_compatible(model.tokenizer, runner.tokenizer, model.vocab_size, runner.vocab_size)
    backend = _RecordingBackend(LocalBackend(Verifier(runner)))
    client = EdgeClient(backend, ModelDrafter(model, valid_vocab_size=valid), model.tokenizer,
                        num_speculative_tokens=num_speculative_tokens)  # fixed γ, no truncation, not proactive
    out: list[RecordedPrompt] = []
    bar = _progress_bar(progress, len(questions), "recording blocks", "prompt")
    try:
        for q in questions:
            ids = encode_prompt(model.tokenizer, q.prompt, chat=True)
            res = client.generate(ids, max_new_tokens=max_new_tokens, temperature=0.0)
            out.append(RecordedPrompt(q.question_id, q.category, list(ids), list(res.token_ids), backend.take()))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        backend.close()
    return tokenizer_fingerprint(model.tokenizer), out


def _save_recording(path: Path, rec: Recording, config: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "format": REPLAY_FORMAT, "key": rec.key, "config": config, "max_new_tokens": rec.max_new_tokens,
        "num_speculative_tokens": rec.num_speculative_tokens, "tokenizer_fingerprint": rec.tokenizer_fingerprint,
        "record_s": rec.record_s,
        "prompts": [
            {"question_id": p.question_id, "category": p.category, "prompt_token_ids": p.prompt_token_ids,
             "output_token_ids": p.output_token_ids,
             "steps": [[s.seq, s.committed_length, s.draft_token_ids, s.num_accepted, s.next_token_id,
                        s.verdict_committed_length, int(s.finished)] for s in p.steps]}
            for p in rec.prompts
        ],
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, separators=(",", ":")))
    os.replace(tmp, path)  # atomic: a concurrent run sees the old file or the whole new one


def _load_recording(path: Path, key: str) -> Recording | None:
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if body.get("format") != REPLAY_FORMAT or body.get("key") != key:
        return None
    prompts = [
        RecordedPrompt(p["question_id"], p["category"], p["prompt_token_ids"], p["output_token_ids"],
                       [RecordedStep(s[0], s[1], s[2], s[3], s[4], s[5], bool(s[6])) for s in p["steps"]])
        for p in body["prompts"]
    ]
    return Recording(key, path, True, body["max_new_tokens"], body["num_speculative_tokens"],
                     body["tokenizer_fingerprint"], prompts, float(body.get("record_s", 0.0)))


def load_or_record(prompts: Path, questions: list[BenchPrompt], limit: int, target_dir: Path, draft_dir: Path,
                   runner_factory, *, max_new_tokens: int, num_speculative_tokens: int, device: str, dtype: str,
                   cache_dir: Path | None = None, progress: bool = False) -> Recording:
    """The cached recording for these inputs, or a new one (recorded with ``runner_factory()``'s runner, then
    cached)."""
    key = recording_key(prompts, limit, target_dir, draft_dir, num_speculative_tokens=num_speculative_tokens,
                        max_new_tokens=max_new_tokens, device=device, dtype=dtype)
    path = _replay_cache_dir(cache_dir) / f"blocks-{key}.json"
    rec = _load_recording(path, key)
    if rec is not None:
        return rec
    t = time.perf_counter()
    fingerprint, recorded = record_blocks(runner_factory(), draft_dir, questions, max_new_tokens=max_new_tokens,
                                          num_speculative_tokens=num_speculative_tokens, progress=progress)
    rec = Recording(key, path, False, max_new_tokens, num_speculative_tokens, fingerprint, recorded,
                    time.perf_counter() - t)
    config = {"prompts": str(Path(prompts).expanduser()), "limit": limit, "target": str(target_dir),
              "draft": str(draft_dir), "device": device, "dtype": dtype}
    _save_recording(path, rec, config)
    return rec


# ---------------------------------------------------------------------------------------------- kernel limit


def measure_kernel_limit(runner, prompts: list[RecordedPrompt], n: int, num_speculative_tokens: int,
                         repeats: int | None = None) -> dict:
    """N single-row target forwards of γ + 1 tokens vs ONE N-row forward over the same contexts.

    Row i: recorded prompt i mod P half-way through its session (its committed length there, its last committed
    token and its recorded block, padded to γ). KV caches are zero-filled (attention costs the same whatever
    the keys hold). Times are medians over ``repeats`` (serial: the sum of the N single-row forwards).
    """
    import numpy as np

    from cloud_verifier.target import ForwardRow

    gamma = num_speculative_tokens
    repeats = repeats or (KERNEL_REPEATS if n > 16 else 2 * KERNEL_REPEATS - 1)
    rows, kvs, contexts = [], [], []
    try:
        for i in range(n):
            p = prompts[i % len(prompts)]
            full = [k for k, s in enumerate(p.steps) if len(s.draft_token_ids) == gamma] or list(range(len(p.steps)))
            k = full[len(full) // 2]
            committed = p.committed_before(k)
            draft = list(p.steps[k].draft_token_ids)
            draft = (draft + committed[-gamma:] * gamma)[:gamma]  # short block (end of a session): padded
            ctx = len(committed)
            kv = runner.allocate(ctx + gamma)
            kv.buffer.zero_()
            kvs.append(kv)
            contexts.append(ctx)
            rows.append(ForwardRow(kv, [committed[-1], *draft], ctx - 1, "all"))
        runner.forward(rows[:1])  # warm-up
        runner.forward(rows)
        serial, batched, serial_cpu, batched_cpu = [], [], [], []
        for r in range(repeats):  # the order alternates: a slow patch of a shared machine hits both alike
            for kind in (("serial", "batched") if r % 2 == 0 else ("batched", "serial")):
                t, c = time.perf_counter(), time.process_time()
                if kind == "serial":
                    for row in rows:
                        runner.forward([row])
                    serial.append(time.perf_counter() - t)
                    serial_cpu.append(time.process_time() - c)
                else:
                    runner.forward(rows)
                    batched.append(time.perf_counter() - t)
                    batched_cpu.append(time.process_time() - c)
    finally:
        for kv in kvs:
            runner.free(kv)
    s, b = float(np.median(serial)), float(np.median(batched))
    return {
        "speedup": _ratio(s, b),
        "speedup_cpu": _ratio(float(np.median(serial_cpu)), float(np.median(batched_cpu))),
        "serial_ms": round(s * 1000, 2),
        "single_row_ms": round(s * 1000 / n, 2),
        "batched_ms": round(b * 1000, 2),
        "single_row_cpu_ms": round(float(np.median(serial_cpu)) * 1000 / n, 2),
        "batched_cpu_ms": round(float(np.median(batched_cpu)) * 1000, 2),
        "mean_context_tokens": round(sum(contexts) / len(contexts), 1),
        "tokens_per_row": gamma + 1,
        "repeats": repeats,
    }


# ---------------------------------------------------------------------------------------------- the replay


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
                          on_window=None) -> ReplayTally:
    """N concurrent sessions replaying recorded blocks against the verifier at ``address`` (see the module
    docstring); every session asks for the recording's ``max_new_tokens`` (the recorded finish states depend
    on it). All N sessions open at once; the measured window of ``duration_s`` s starts when every slot has had
    its first verdict (the initial burst of N prefills is not steady state), or after ``ramp_timeout_s`` s.
    Errors and mismatches count from the start. Must run on an asyncio loop; returns when every session is
    closed. Deadlines are the SDK's defaults (GrpcBackend's OpenSession 300 s, EdgeClient's verify step 60 s):
    a session past one counts as an error. ``on_window``: called with "start" when the window opens and "end"
    when it closes (e.g. to read the verifier's CPU time)."""
    import grpc

    from common.types import SamplingParams, StoppingCriteria
    from common.wire import open_request_to_proto
    from edge_client.grpc_backend import CHANNEL_OPTIONS
    from specdec.v1 import verifier_pb2 as pb
    from specdec.v1 import verifier_pb2_grpc as pb_grpc

    loop = asyncio.get_running_loop()
    tally = ReplayTally()
    counter = {"next": 0}
    t_start = loop.time()
    window = {"start": None, "end": float("inf"), "ready": 0}

    def open_window(timed_out: bool = False) -> None:
        if window["start"] is None:
            window["start"] = loop.time()
            window["end"] = window["start"] + duration_s
            tally.ramp_s = window["start"] - t_start
            tally.ramp_timed_out = timed_out
            if on_window is not None:
                on_window("start")
                loop.call_later(duration_s, on_window, "end")

    async def ramp_watchdog() -> None:
        await asyncio.sleep(ramp_timeout_s)
        open_window(timed_out=True)

    def next_prompt() -> RecordedPrompt:
        i = counter["next"]
        counter["next"] += 1
        return prompts[i % len(prompts)]

    async def slot() -> None:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = pb_grpc.VerifierStub(channel)
        call = None
        first_verdict = True
        try:
            while loop.time() < window["end"]:
                p = next_prompt()
                request = open_request_to_proto(p.prompt_token_ids, SamplingParams(),
                                                StoppingCriteria(max_new_tokens=max_new_tokens),
                                                tokenizer_fingerprint)
                try:
                    opened = await stub.OpenSession(request, timeout=open_timeout_s)
                except grpc.aio.AioRpcError as e:
                    tally.error(f"OpenSession: {_rpc_error_text(e)}")
                    await asyncio.sleep(0.05)
                    continue
                tally.sessions_started += 1
                sid = opened.session_id
                completed = opened.committed_length == len(p.prompt_token_ids)
                if not completed:
                    tally.error(f"OpenSession: committed_length {opened.committed_length} != prompt length "
                                f"{len(p.prompt_token_ids)}")
                try:
                    for step in p.steps if completed else ():
                        if loop.time() >= window["end"]:
                            completed = False
                            break
                        if call is None:
                            call = stub.Verify()
                        msg = pb.DraftBlock(session_id=sid, seq=step.seq, committed_length=step.committed_length,
                                            draft_token_ids=step.draft_token_ids)
                        t0 = time.perf_counter()
                        v = await asyncio.wait_for(_exchange(call, msg), verify_timeout_s)
                        t1 = time.perf_counter()
                        if v is grpc.aio.EOF:
                            raise RuntimeError("the Verify stream ended without a verdict")
                        if first_verdict:
                            first_verdict = False
                            window["ready"] += 1
                            if window["ready"] == n:
                                open_window()
                        elif window["start"] is not None and loop.time() <= window["end"]:
                            tally.verdicts += 1
                            tally.tokens += v.committed_length - step.committed_length
                            tally.batch_size_sum += v.batch_size
                            tally.latencies_s.append(t1 - t0)
                        got = (v.num_accepted, v.next_token_id, v.committed_length, v.finished)
                        if got != step.expected() or v.seq != step.seq:
                            tally.mismatches += 1
                            if len(tally.mismatch_samples) < 5:
                                tally.mismatch_samples.append({"question_id": p.question_id, "seq": step.seq,
                                                               "expected": list(step.expected()), "got": list(got)})
                            completed = False
                            break
                    if completed and window["start"] is not None:
                        tally.sessions_completed += 1
                except (grpc.aio.AioRpcError, RuntimeError, asyncio.TimeoutError) as e:
                    tally.error(f"Verify: {_rpc_error_text(e)}")
                    if call is not None:
                        call.cancel()
                    call = None
                finally:
                    try:
                        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=verify_timeout_s)
                    except grpc.aio.AioRpcError as e:
                        tally.error(f"CloseSession: {_rpc_error_text(e)}")
        finally:
            if call is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(call.done_writing(), 5.0)
                    await asyncio.wait_for(call.read(), 5.0)  # EOF: the server ended the stream
                call.cancel()
            await channel.close()

    watchdog = asyncio.create_task(ramp_watchdog())
    try:
        results = await asyncio.gather(*(slot() for _ in range(n)), return_exceptions=True)
    finally:
        watchdog.cancel()
    for r in results:
        if isinstance(r, BaseException):
            tally.error(f"session slot failed: {type(r).__name__}: {r}")
    end = loop.time()
    tally.window_s = duration_s if window["start"] is not None else 0.0
    tally.drain_s = max(0.0, end - window["end"]) if window["start"] is not None else 0.0
    return tally


async def _exchange(call, msg):
    """Send one block on the Verify stream and read its verdict."""
    await call.write(msg)
    return await call.read()


def _tally_metrics(t: ReplayTally) -> dict:
    import numpy as np

    lat = np.array(t.latencies_s) * 1000 if t.latencies_s else None
    return {
        "tokens_per_s": _ratio(t.tokens, t.window_s),
        "mean_batch_size": _ratio(t.batch_size_sum, t.verdicts),
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
        "window_s": t.window_s,
        "ramp_s": round(t.ramp_s, 2),
        **({"ramp_timed_out": True} if t.ramp_timed_out else {}),
        "drain_s": round(t.drain_s, 2),
        **({"error_samples": t.error_samples} if t.error_samples else {}),
        **({"mismatch_samples": t.mismatch_samples} if t.mismatch_samples else {}),
    }


# ---------------------------------------------------------------------------------------------- memory of the verifier


def _read_metric(url: str, name: str) -> float | None:
    import urllib.request

    try:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return None
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _proc_status_bytes(pid: int, field_name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _proc_cpu_s(pid: int | None) -> float | None:
    """CPU time (user + system, all threads) of process ``pid`` so far, s."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def verifier_memory(proc: _VerifierProcess) -> dict:
    """The verifier process's reserved KV (/metrics ``specdec_kv_cache_used_bytes``), open sessions and VmRSS."""
    pid = proc.proc.pid if proc.proc is not None else None
    url = proc.metrics_url
    return {
        "kv_cache_used_bytes": _read_metric(url, "specdec_kv_cache_used_bytes") if url else None,
        "sessions_open": _read_metric(url, "specdec_sessions_open") if url else None,
        "rss_bytes": _proc_status_bytes(pid, "VmRSS") if pid else None,
    }


async def _poll_peak(proc: _VerifierProcess, peak: dict, stop: asyncio.Event, period_s: float = 1.0) -> None:
    """Track the peak KV reservation and RSS of the verifier while a run lasts (one read per period)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        m = await loop.run_in_executor(None, verifier_memory, proc)
        for k in ("kv_cache_used_bytes", "rss_bytes"):
            if m.get(k) is not None:
                peak[k] = max(peak.get(k) or 0, m[k])
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


def _settled_memory(proc: _VerifierProcess, idle_rss: int | None, timeout_s: float = 12.0) -> dict:
    """Memory after a run: polled until no session is open, the KV reservation is 0 and RSS is within
    RSS_IDLE_TOLERANCE_BYTES of ``idle_rss`` (or ``timeout_s`` passes: the verifier's reaper gives freed heap
    pages back once per reap interval, 5 s by default, when it finds no session); the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = verifier_memory(proc)
        settled = (m["sessions_open"] in (0, None) and m["kv_cache_used_bytes"] in (0, None)
                   and (idle_rss is None or m["rss_bytes"] is None
                        or m["rss_bytes"] <= idle_rss + RSS_IDLE_TOLERANCE_BYTES))
        if settled or time.monotonic() > deadline:
            m["settle_s"] = round(timeout_s - max(0.0, deadline - time.monotonic()), 1)
            return m
        time.sleep(0.5)


def _rss_back(idle: int | None, after: int | None) -> bool:
    if idle is None or after is None:
        return True
    return after <= idle + max(RSS_IDLE_TOLERANCE * idle, RSS_IDLE_TOLERANCE_BYTES)


# ---------------------------------------------------------------------------------------------- the bench


def _core_plan(pin: bool, notes: list[str]) -> tuple[set[int] | None, set[int] | None]:
    """(load generator cores, verifier cores): the first allowed core, and the rest; (None, None) unpinned."""
    if not pin:
        notes.append("CPU pinning off: the load generator and the verifier share every core")
        return None, None
    if not hasattr(os, "sched_getaffinity"):
        notes.append("CPU pinning unavailable on this platform: load generator and verifier NOT pinned")
        return None, None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        notes.append(f"only {len(allowed)} core allowed: load generator and verifier NOT pinned apart")
        return None, None
    return {allowed[0]}, set(allowed[1:])


def _check_replay_args(client_counts, duration_s: float, max_new_tokens: int, num_speculative_tokens: int,
                       max_batch_size: int) -> list[int]:
    from common.errors import InvalidRequestError

    counts = list(dict.fromkeys(int(c) for c in client_counts))
    if not counts or min(counts) < 1:
        raise InvalidRequestError(f"client counts must be >= 1, got {client_counts}")
    if not duration_s > 0:
        raise InvalidRequestError(f"--duration-s must be > 0, got {duration_s}")
    if max_new_tokens < 1 or num_speculative_tokens < 1 or max_batch_size < 1:
        raise InvalidRequestError("max_new_tokens, num_speculative_tokens and max_batch_size must be >= 1")
    return counts


def run_replay_bench(
    prompts: Path,
    client_counts: list[int],
    *,
    duration_s: float = REPLAY_DEFAULT_DURATION_S,
    limit: int | None = None,
    max_new_tokens: int = 128,
    num_speculative_tokens: int = 4,
    target: Path | None = None,
    draft: Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    max_batch_size: int | None = None,
    warmup_s: float = REPLAY_WARMUP_S,
    serial: bool = True,
    pin: bool = True,
    cache_dir: Path | None = None,
    progress: bool = False,
    startup_timeout_s: float = VERIFIER_STARTUP_TIMEOUT_S,
) -> dict:
    """Replay recorded draft blocks from N concurrent sessions against a verifier process (module docstring).

    Returns ``{"replay": {"N": {"tokens_per_s", "speedup_vs_serial", "kernel_limit_speedup", "mean_batch_size",
    "verify_latency_ms": {"p50", "p99"}, "errors", "mismatches", "sessions_completed", "serial": {...},
    "kernel": {...}, "memory": {...}, ...}}, "recording": {...}, "config": {...}, "notes": [...]}``.
    ``serial=False`` skips the one-block-per-forward verifier (no ``speedup_vs_serial``). ``device``/``dtype``:
    the target's (verifiers, recording, kernel limit); None = :func:`~specdec.bench._shared.target_placement`'s.
    """
    import torch

    from cloud_verifier.target import TargetRunner, resolve_device, resolve_dtype
    from .edge_cloud import _set_process_affinity

    counts = _check_replay_args(client_counts, duration_s, max_new_tokens, num_speculative_tokens,
                                max_batch_size or 1)
    if max_batch_size is None:  # the batched verifier can take every session's block into one pass (kernel limit)
        max_batch_size = max(32, max(counts))
    notes: list[str] = []
    if limit is None:
        limit = REPLAY_DEFAULT_LIMIT
        notes.append(f"no --limit: {limit} prompts (round-robin across categories), recorded once and cached")
    questions = load_prompts(prompts, limit)
    target_dir, draft_dir = _resolve_dirs(target, draft)
    placement = _target_placement()
    dev = resolve_device(device or placement["device"])
    dt = resolve_dtype(dtype or placement["dtype"], dev)
    dtype_name = str(dt).replace("torch.", "")
    t0 = time.perf_counter()
    runner_box: list = []

    def runner_factory():
        if not runner_box:
            runner_box.append(TargetRunner(target_dir, device=str(dev), dtype=dt))
        return runner_box[0]

    rec = load_or_record(prompts, questions, limit, target_dir, draft_dir, runner_factory,
                         max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens,
                         device=str(dev), dtype=dtype_name, cache_dir=cache_dir, progress=progress)
    runner = runner_factory()
    lg_cores, v_cores = _core_plan(pin, notes)
    v_threads = len(v_cores) if v_cores else max(1, (os.cpu_count() or 2) // 2)
    env = {"SPECDEC_DEVICE": str(dev), "SPECDEC_DTYPE": dtype_name, "SPECDEC_MAX_BATCH_SIZE": str(max_batch_size),
           "SPECDEC_MAX_SESSIONS": str(max(256, 2 * max(counts)))}
    batched_proc = _VerifierProcess(target_dir, None, startup_timeout_s, cores=v_cores, metrics=True, env=env,
                                    torch_threads=v_threads)
    serial_proc = (_VerifierProcess(target_dir, None, startup_timeout_s, cores=v_cores, metrics=True,
                                    env={**env, "SPECDEC_MAX_BATCH_SIZE": "1"}, torch_threads=v_threads)
                   if serial else None)
    saved_affinity = os.sched_getaffinity(0) if lg_cores else None
    saved_threads = torch.get_num_threads()
    report: dict[str, dict] = {}
    bar = None
    try:
        if lg_cores:
            _set_process_affinity(lg_cores)
        procs = [p for p in (batched_proc, serial_proc) if p is not None]
        for p in procs:
            p.start()
        for p in procs:  # untimed: first forward passes, allocator growth, channels
            asyncio.run(replay_sessions(p.address, rec.prompts, min(4, max(counts)), warmup_s,
                                        max_new_tokens=rec.max_new_tokens,
                                        tokenizer_fingerprint=rec.tokenizer_fingerprint))
        bar = _progress_bar(progress, len(counts), "replay", "N")
        for i, n in enumerate(counts):
            report[str(n)] = _measure_n(
                n, i, rec, runner, batched_proc, serial_proc, duration_s=duration_s, lg_cores=lg_cores,
                v_cores=v_cores, v_threads=v_threads, num_speculative_tokens=num_speculative_tokens,
            )
            torch.set_num_threads(saved_threads)
            if bar is not None:
                bar.set_postfix_str(f"N={n} {report[str(n)]['tokens_per_s'] or 0:.1f} tok/s", refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        exit_status = {}
        for name, p in (("batched", batched_proc), ("serial", serial_proc)):
            if p is not None:
                with contextlib.suppress(Exception):
                    exit_status[name] = p.stop()
                p.remove_log()
        if saved_affinity is not None:
            _set_process_affinity(saved_affinity)
        torch.set_num_threads(saved_threads)
    notes += [
        "tokens_per_s = committed tokens of the verdicts received inside the window / the window (sessions open, "
        "prefill and close included); the window starts once every session slot has had its first verdict "
        "(ramp_s: the initial burst of N prefills); speedup_vs_serial = tokens_per_s / that of the same verifier "
        f"process type with max_batch_size=1 driven by min(N, {SERIAL_CLIENTS}) sessions over the same window "
        "(one block per forward pass whatever is queued: its throughput does not depend on N)",
        "kernel_limit_speedup = time of N single-row target forwards of γ+1 tokens / one N-row forward over the "
        "same contexts, measured in this process on the verifier's cores with its thread count while both "
        "verifiers are idle; it leaves out prefill, which does not batch (see kernel.prefill_share)",
        "each verdict is compared with the recorded one (num_accepted, next_token_id, committed_length, "
        "finished): a difference is a mismatch and abandons the session",
    ]
    config = {
        "prompts": str(Path(prompts).expanduser()),
        "limit": limit,
        "num_prompts": len(rec.prompts),
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "max_new_tokens": max_new_tokens,
        "num_speculative_tokens": num_speculative_tokens,
        "max_batch_size": max_batch_size,
        "device": str(dev),
        "dtype": dtype_name,
        "decoding": "greedy",
        "transport": "grpc.aio on loopback: one channel and one Verify stream per session slot, one asyncio process",
        "load_generator_cores": sorted(lg_cores) if lg_cores else None,
        "verifier_cores": sorted(v_cores) if v_cores else None,
        "verifier_torch_threads": v_threads,
        "verifier_pinned_with": batched_proc.pinned_with,
        "verifier_exit_status": exit_status,
        "target": str(target_dir),
        "draft": str(draft_dir),
        "cpu_count": os.cpu_count(),
        "threading": _threading_config(),
        "versions": _versions(),
        "run_s": round(time.perf_counter() - t0, 2),
    }
    recording = {
        "path": str(rec.path),
        "cached": rec.cached,
        "record_s": round(rec.record_s, 2),
        "num_prompts": len(rec.prompts),
        "num_blocks": rec.num_steps,
        "num_output_tokens": sum(len(p.output_token_ids) for p in rec.prompts),
        "mean_prompt_tokens": round(sum(len(p.prompt_token_ids) for p in rec.prompts) / len(rec.prompts), 1),
        "mean_accepted_length": _ratio(sum(len(p.output_token_ids) for p in rec.prompts), rec.num_steps),
    }
    return {"replay": report, "recording": recording, "config": config, "notes": notes}


def _measure_n(n: int, index: int, rec: Recording, runner, batched_proc: _VerifierProcess,
               serial_proc: _VerifierProcess | None, *, duration_s: float, lg_cores, v_cores, v_threads: int,
               num_speculative_tokens: int) -> dict:
    """Kernel limit, then the batched and the serial replay (order alternating with ``index``), for one N."""
    import torch

    from .edge_cloud import _set_process_affinity

    if v_cores:
        _set_process_affinity(v_cores)
    torch.set_num_threads(v_threads)
    try:
        kernel = measure_kernel_limit(runner, rec.prompts, n, num_speculative_tokens)
    finally:
        if lg_cores:
            _set_process_affinity(lg_cores)
    kernel["prefill_share"] = _prefill_share(runner, rec, kernel, v_cores, lg_cores, v_threads)
    order = ["batched", "serial"] if index % 2 == 0 else ["serial", "batched"]
    out: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    for mode in order:
        if mode == "serial" and serial_proc is None:
            continue
        proc = batched_proc if mode == "batched" else serial_proc
        idle = verifier_memory(proc)
        peak: dict = {}

        clients = n if mode == "batched" else min(n, SERIAL_CLIENTS)

        cpu: dict[str, float | None] = {}
        pid = proc.proc.pid if proc.proc is not None else None

        async def run():
            stop = asyncio.Event()
            poller = asyncio.create_task(_poll_peak(proc, peak, stop))
            try:
                return await replay_sessions(proc.address, rec.prompts, clients, duration_s,
                                             max_new_tokens=rec.max_new_tokens,
                                             tokenizer_fingerprint=rec.tokenizer_fingerprint,
                                             on_window=lambda what: cpu.__setitem__(what, _proc_cpu_s(pid)))
            finally:
                stop.set()
                await poller

        tally = asyncio.run(run())
        after = _settled_memory(proc, idle["rss_bytes"])
        out[mode] = {"clients": clients, **_tally_metrics(tally)}
        cpu_s = (cpu["end"] - cpu["start"]) if cpu.get("end") is not None and cpu.get("start") is not None else None
        out[mode]["verifier_cpu_s"] = round(cpu_s, 2) if cpu_s is not None else None
        out[mode]["tokens_per_verifier_cpu_s"] = _ratio(tally.tokens, cpu_s or 0)
        if mode == "batched":
            memory = {
                "idle": idle, "peak": peak, "after": after,
                "kv_back_to_idle": after["kv_cache_used_bytes"] == idle["kv_cache_used_bytes"],
                "rss_back_to_idle": _rss_back(idle["rss_bytes"], after["rss_bytes"]),
                "rss_tolerance": f"{RSS_IDLE_TOLERANCE:.0%} of idle or {RSS_IDLE_TOLERANCE_BYTES >> 20} MiB",
            }
    batched = out["batched"]
    entry = {
        "tokens_per_s": batched["tokens_per_s"],
        "speedup_vs_serial": (_ratio(batched["tokens_per_s"] or 0, out["serial"]["tokens_per_s"] or 0)
                              if "serial" in out else None),
        "kernel_limit_speedup": kernel["speedup"],
        **{k: v for k, v in batched.items() if k != "tokens_per_s"},
        "kernel": kernel,
        "memory": memory,
    }
    if "serial" in out:
        entry["serial"] = out["serial"]
        if entry["speedup_vs_serial"] and kernel["speedup"]:
            entry["fraction_of_kernel_limit"] = round(entry["speedup_vs_serial"] / kernel["speedup"], 3)
        # the same ratios per CPU second of the verifier (kernel: of this process): what other jobs on a shared
        # machine take from the verifier's core drops out
        cpu_speedup = _ratio(batched["tokens_per_verifier_cpu_s"] or 0, out["serial"]["tokens_per_verifier_cpu_s"] or 0)
        entry["speedup_vs_serial_cpu"] = cpu_speedup
        if cpu_speedup and kernel.get("speedup_cpu"):
            entry["fraction_of_kernel_limit_cpu"] = round(cpu_speedup / kernel["speedup_cpu"], 3)
        with_prefill = kernel["prefill_share"]["kernel_limit_speedup_with_prefill"]
        if cpu_speedup and with_prefill:
            entry["fraction_of_kernel_limit_with_prefill_cpu"] = round(cpu_speedup / with_prefill, 3)
    return entry


def _prefill_share(runner, rec: Recording, kernel: dict, v_cores, lg_cores, v_threads: int) -> dict:
    """How much of the replayed work is prefill, in kernel time: one forward of a typical prompt prefill
    chunk vs the recorded sessions' verify forwards, serial and batched (explains a speedup below the kernel
    limit: prefill is compute-bound and gains nothing from batching)."""
    import torch

    from cloud_verifier.target import ForwardRow
    from .edge_cloud import _set_process_affinity

    lengths = sorted(len(p.prompt_token_ids) for p in rec.prompts)
    median = lengths[len(lengths) // 2]
    if v_cores:
        _set_process_affinity(v_cores)
    torch.set_num_threads(v_threads)
    kv = runner.allocate(median)
    times = []
    try:
        for _ in range(2):
            c = time.process_time()
            runner.forward([ForwardRow(kv, [1] * (median - 1), 0, "none")])
            times.append((time.process_time() - c) * 1000)
    finally:
        runner.free(kv)
        if lg_cores:
            _set_process_affinity(lg_cores)
    per_token_ms = min(times) / max(1, median - 1)
    prefill_ms = sum(len(p.prompt_token_ids) - 1 for p in rec.prompts) * per_token_ms
    blocks = rec.num_steps
    n_rows = round(kernel["serial_ms"] / kernel["single_row_ms"]) if kernel["single_row_ms"] else 1
    serial_ms = blocks * kernel["single_row_cpu_ms"] + prefill_ms
    batched_ms = blocks * kernel["batched_cpu_ms"] / n_rows + prefill_ms
    return {
        "basis": "CPU time of the recorded workload's forwards: every prompt prefilled once, every block verified "
                 "alone (serial) or in full N-row forwards (batched)",
        "prefill_cpu_ms_per_prompt_token": round(per_token_ms, 3),
        "of_serial_kernel_time": round(prefill_ms / serial_ms, 3),
        "of_batched_kernel_time": round(prefill_ms / batched_ms, 3),
        "kernel_limit_speedup_with_prefill": round(serial_ms / batched_ms, 3),
    }


def print_replay_report(report: dict, console) -> None:
    """The ``--replay`` report as a rich table (``specdec bench --replay`` without ``--json``)."""
    from rich.table import Table

    from .report import _fmt

    t = Table(title="Verifier under load: recorded blocks replayed by one asyncio process (verifier in its own process)")
    for col in ("N", "tok/s", "serial tok/s", "speedup vs serial", "kernel limit", "kernel limit w/ prefill",
                "mean batch", "p50 ms", "p99 ms", "errors", "mismatches", "sessions done", "KV after", "RSS idle→after"):
        t.add_column(col, justify="right")
    for n, m in report["replay"].items():
        mem = m.get("memory") or {}
        idle, after = mem.get("idle") or {}, mem.get("after") or {}
        rss = (f"{(idle.get('rss_bytes') or 0) / 2**20:.0f}→{(after.get('rss_bytes') or 0) / 2**20:.0f} MiB"
               if idle.get("rss_bytes") else "—")
        t.add_row(n, _fmt(m["tokens_per_s"], ".1f"), _fmt((m.get("serial") or {}).get("tokens_per_s"), ".1f"),
                  _fmt(m["speedup_vs_serial"]), _fmt(m["kernel_limit_speedup"]),
                  _fmt(m["kernel"]["prefill_share"]["kernel_limit_speedup_with_prefill"]),
                  _fmt(m["mean_batch_size"]), _fmt(m["verify_latency_ms"]["p50"], ".1f"),
                  _fmt(m["verify_latency_ms"]["p99"], ".1f"), str(m["errors"]), str(m["mismatches"]),
                  str(m["sessions_completed"]), _fmt(after.get("kv_cache_used_bytes"), ".0f"), rss)
    console.print(t)
