"""Starting, watching and stopping the ranks of a tensor-parallel verifier (torch.distributed, torch.multiprocessing).

:func:`start_parallel_runner` (rank 0, the process that serves gRPC) either starts ranks 1..N-1 itself
(``torch.multiprocessing`` spawn, a free TCP port on 127.0.0.1 as the process group's rendezvous) or, under
torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set), joins the group torchrun set up; a
torchrun rank > 0 calls :func:`run_rank` instead. Backend: NCCL with CUDA (rank r on ``cuda:LOCAL_RANK``), gloo
on the CPU.

Every rank loads the target (:class:`~cloud_verifier.target.runner.TargetRunner`; rank 0 also runs the
single-device self-check on the whole model), cuts it to its shard (:mod:`cloud_verifier.parallel.sharding`) and
allocates its own KV pool for its own KV heads (same page count on every rank: page ids are rank 0's). The ranks
then exchange one status each (``all_gather_object``): a rank that failed makes start-up fail with its line.

Failure: rank 0 watches its ranks (process sentinels); a rank that exits marks the group failed
(:attr:`ParallelRanks.failure`: forwards raise UNAVAILABLE), the ``on_failure`` callbacks run (``serve`` turns
health NOT_SERVING and stops the replica), then the other ranks are stopped. The sentinel of a process is ready
the moment it exits, so a SIGKILLed rank turns the replica NOT_SERVING within milliseconds, not after a
collective's timeout (scripts/tensor_parallel_kill_check.py measures it). Under torchrun (no child processes to
watch) a dead rank is found by the next collective: a step, or the idle heartbeat every :data:`HEARTBEAT_S`.
Ranks > 0 exit when a collective fails (rank 0 gone) or their parent dies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from specdec_runtime.cloud_verifier.parallel.sharding import (AllReduceTimer, TensorParallelError, plan_shards,
                                                              shard_model, weight_bytes)
from specdec_runtime.cloud_verifier.parallel.step import NOOP, STOP, StepBroadcaster, broadcast_command, serve_steps
from specdec_runtime.common.errors import VerifierUnavailableError

log = logging.getLogger(__name__)
HEARTBEAT_S = 5.0  # rank 0 sends a NOOP step this often while idle (the group's timeout is far longer)
STOP_WAIT_S = 10.0  # how long rank 0 waits for a rank to exit before killing it
CHECK_IDS = 12  # tokens of the tensor-parallel self-check


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What every rank needs to load its shard (picklable: sent to spawned ranks)."""

    model_dir: str
    world_size: int
    init_method: str  # "env://" (torchrun) or "tcp://127.0.0.1:PORT"
    device: str  # "cpu" or "cuda"
    dtype: str
    kv_cache_budget_tokens: int
    kv_page_size: int
    num_threads: int | None
    timeout_s: float = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_of(spec: RankSpec, rank: int) -> str:
    if spec.device.startswith("cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    return "cpu"


def _init_group(spec: RankSpec, rank: int):
    device = _device_of(spec, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=spec.init_method, rank=rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.timeout_s))
    return dist.group.WORLD, device


def _load_shard(spec: RankSpec, rank: int, device: str, group, timer: AllReduceTimer, check: bool):
    """The rank's runner, cut to its shard, with a KV pool of its own heads; (runner, reference logits or None)."""
    from specdec_runtime.cloud_verifier.kv.pool import KVPool
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner, resolve_dtype

    threads = spec.num_threads or max(1, (os.cpu_count() or 1) // spec.world_size) if device == "cpu" else None
    target = torch.device(device)
    # loaded on the host and cut there: the device only ever holds this rank's shard; a one-page pool while
    # loading (the real one holds only this rank's KV heads)
    runner = TargetRunner(spec.model_dir, kv_cache_budget_tokens=max(CHECK_IDS, spec.kv_page_size), device="cpu",
                          dtype=resolve_dtype(spec.dtype, target), num_threads=threads, check_architecture=check,
                          kv_page_size=spec.kv_page_size)
    plan = plan_shards(runner.config, spec.world_size)
    ids = [(i * 7919 + 11) % min(runner.vocab_size, 32000) for i in range(CHECK_IDS)]
    reference = runner.reference_logits(ids) if check else None
    shard_model(runner.model, plan, rank, group, timer)
    if target.type != "cpu":
        runner.model.to(target)
        runner.device = target
    runner.num_kv_heads = len(plan.kv_heads[rank])
    num_pages = -(-int(spec.kv_cache_budget_tokens) // int(spec.kv_page_size))
    runner.kv_pool = KVPool(runner.num_layers, num_pages, spec.kv_page_size, runner.num_kv_heads, runner.head_dim,
                            runner.dtype, runner.device)
    runner.kv_cache_budget_tokens = int(spec.kv_cache_budget_tokens)
    return runner, reference, plan


def _gather_status(rank: int, group, status: dict) -> list[dict]:
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, status, group=group)
    return out


def run_rank(spec: RankSpec, rank: int, parent_pid: int | None = None) -> int:
    """A rank > 0: join the group, load its shard, report, then serve steps until STOP. Returns an exit code
    (0 after STOP, 1 when a collective failed or start-up failed on any rank)."""
    if parent_pid is not None:  # spawned by serve: never outlive it
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    group, device = _init_group(spec, rank)
    timer = AllReduceTimer()
    runner, status = None, {"error": None}
    try:
        runner, _, _ = _load_shard(spec, rank, device, group, timer, check=False)
        status.update(weight_bytes=weight_bytes(runner.model), kv_bytes=_pool_bytes(runner))
    except Exception as exc:  # noqa: BLE001 - reported to rank 0 as one line
        status["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    try:
        if any(s["error"] for s in _gather_status(rank, group, status)):
            return 1
        serve_steps(runner, group)
        return 0
    except RuntimeError as exc:
        log.error("tensor-parallel rank %d: %s; exiting", rank, str(exc).splitlines()[0])
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawned_rank(spec: RankSpec, rank: int, parent_pid: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    os._exit(run_rank(spec, rank, parent_pid))


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def _pool_bytes(runner) -> int:
    return runner.kv_pool.tensor.numel() * runner.kv_pool.tensor.element_size()


class ParallelRanks:
    """Rank 0's view of the group: the spawned rank processes, the failure state, the idle heartbeat, stop.

    ``per_rank``: one dict per rank (``weight_bytes``, ``kv_bytes``); ``timer``: rank 0's all-reduce timer.
    ``failure``: None, or why the group cannot serve (a rank exited, a collective failed): one line.
    """

    def __init__(self, runner, group, procs: list, per_rank: list[dict], timer: AllReduceTimer):
        self.runner, self.group, self.procs, self.per_rank, self.timer = runner, group, procs, per_rank, timer
        self.world_size = dist.get_world_size(group)
        self.failure: str | None = None
        self.last_allreduce_s = 0.0  # rank 0's all-reduce wall time in the last forward pass, s
        self.on_failure: list = []  # callables run once (from a watcher thread) when the group fails
        self._closed = threading.Event()
        self._failed_once = threading.Lock()
        self._terminating = threading.Lock()
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def check(self) -> None:
        """Raises VerifierUnavailableError once the group has failed (before a step is broadcast)."""
        if self.failure is not None:
            raise VerifierUnavailableError(f"this verifier's tensor-parallel group failed: {self.failure}")

    def step_done(self) -> None:
        """After each forward pass: the pass's all-reduce seconds into ``last_allreduce_s`` and the metrics."""
        from specdec_runtime.cloud_verifier import metrics

        self.last_allreduce_s = self.timer.take()
        metrics.TP_ALLREDUCE_TIME.observe(self.last_allreduce_s)

    def collective_failed(self, exc: BaseException) -> Exception:
        """A step failed on rank 0 after it was broadcast (a collective raised, or the pass itself): the group is
        failed; the error a forward raises (UNAVAILABLE: clients retry elsewhere)."""
        self.fail(f"a step failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return VerifierUnavailableError(f"this verifier's tensor-parallel group failed: {self.failure}")

    def fail(self, reason: str) -> None:
        """Mark the group failed (first reason wins), run the ``on_failure`` callbacks, stop the other ranks.

        The callbacks (``serve``: health NOT_SERVING, graceful stop) run first: stopping the other ranks may wait
        up to :data:`STOP_WAIT_S` per rank, and a replica whose group failed must leave SERVING at once."""
        if not self._failed_once.acquire(blocking=False):
            return
        self.failure = reason
        log.error("tensor parallel: %s; this replica stops serving", reason)
        for callback in self.on_failure:
            callback(reason)
        self._terminate()

    def _watch(self) -> None:
        """Until close: a spawned rank that exits fails the group; an idle group gets a NOOP step every
        HEARTBEAT_S (it keeps the waiting ranks inside the group's timeout)."""
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: r for r, p in enumerate(self.procs, start=1)}
        while not self._closed.is_set() and self.failure is None:
            ready = wait(list(sentinels), timeout=HEARTBEAT_S) if sentinels else self._closed.wait(HEARTBEAT_S)
            if self._closed.is_set():
                return
            if ready and sentinels:
                rank = sentinels[ready[0]]
                self.procs[rank - 1].join(1.0)  # the exit code is read once the process is reaped
                self.fail(f"rank {rank} exited (exit code {self.procs[rank - 1].exitcode})")
                return
            if self.runner.forward_lock.acquire(blocking=False):
                try:
                    if self.failure is None and not self._closed.is_set():
                        broadcast_command(NOOP, self.group, self.runner.device)
                except RuntimeError as exc:
                    self.collective_failed(exc)
                finally:
                    self.runner.forward_lock.release()

    def _terminate(self) -> None:
        with self._terminating:  # the watcher (after a failure) and close() may both get here: one reaps
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
            deadline = time.monotonic() + STOP_WAIT_S
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(STOP_WAIT_S)

    def close(self) -> None:
        """Stop every rank: STOP broadcast (a healthy group), then join; terminate what is left. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.failure is None:
            with self.runner.forward_lock:
                try:
                    broadcast_command(STOP, self.group, self.runner.device)
                except RuntimeError:
                    pass
        deadline = time.monotonic() + STOP_WAIT_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._terminate()
        if dist.is_initialized() and self.failure is None:
            dist.destroy_process_group()


def rank_spec(settings, world_size: int) -> RankSpec:
    """The :class:`RankSpec` of :class:`cloud_verifier.config.VerifierSettings` (the default target when unset)."""
    from specdec_runtime.common.paths import default_model_paths, resolve_target_dir

    device = str(settings.device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    init = "env://" if torchrun else f"tcp://127.0.0.1:{_free_port()}"
    if torchrun and int(os.environ["WORLD_SIZE"]) != world_size:
        raise TensorParallelError(f"tensor parallel {world_size}, but torchrun started WORLD_SIZE="
                                  f"{os.environ['WORLD_SIZE']} ranks")
    if device.startswith("cuda") and torch.cuda.device_count() < world_size and not torchrun:
        raise TensorParallelError(f"tensor parallel {world_size} needs {world_size} CUDA devices, "
                                  f"{torch.cuda.device_count()} found")
    target = str(resolve_target_dir(settings.target or default_model_paths().target_dir))
    return RankSpec(target, world_size, init, "cuda" if device.startswith("cuda") else "cpu", settings.dtype,
                    settings.kv_cache_budget_tokens, settings.kv_page_size, settings.torch_threads)


def start_parallel_runner(spec: RankSpec):
    """Rank 0: start ranks 1..N-1 (unless torchrun did), load rank 0's shard, check the group's forward against
    the whole model's reference; returns the runner (``runner.parallel``: :class:`ParallelRanks`).

    Raises:
        TensorParallelError: a rank failed to start (its line), or the sharded forward differs from the
            reference (one line).
    """
    procs = []
    if spec.init_method != "env://":
        ctx = torch.multiprocessing.get_context("spawn")
        for rank in range(1, spec.world_size):
            p = ctx.Process(target=_spawned_rank, args=(spec, rank, os.getpid()), name=f"specdec-tp-rank{rank}",
                            daemon=True)  # never outlive rank 0's interpreter (multiprocessing ends them at exit)
            p.start()
            procs.append(p)
        log.info("tensor parallel %d: started ranks %s (pids %s)", spec.world_size,
                 ", ".join(str(r) for r in range(1, spec.world_size)), ", ".join(str(p.pid) for p in procs))
    try:
        group, device = _init_group(spec, 0)
        timer = AllReduceTimer()
        runner, reference, status = None, None, {"error": None}
        try:
            runner, reference, plan = _load_shard(spec, 0, device, group, timer, check=True)
            status.update(weight_bytes=weight_bytes(runner.model), kv_bytes=_pool_bytes(runner))
        except Exception as exc:  # noqa: BLE001 - gathered, raised below as one line
            status["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        per_rank = _gather_status(0, group, status)
        for r, s in enumerate(per_rank):
            if s["error"]:
                raise TensorParallelError(s["error"] if r == 0 else f"tensor-parallel rank {r}: {s['error']}")
    except BaseException:
        for p in procs:
            p.join(STOP_WAIT_S)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    ranks = ParallelRanks(runner, group, procs, per_rank, timer)
    runner.parallel = ranks
    runner.decoder = StepBroadcaster(runner.decoder, group, runner.device, ranks.check, ranks.step_done,
                                    ranks.collective_failed)
    from specdec_runtime.cloud_verifier import metrics

    metrics.TP_WORLD_SIZE.set(spec.world_size)
    for r, s in enumerate(per_rank):
        metrics.TP_RANK_WEIGHT_BYTES.labels(rank=str(r)).set(s["weight_bytes"])
        metrics.TP_RANK_KV_BYTES.labels(rank=str(r)).set(s["kv_bytes"])
        log.info("tensor parallel rank %d: %d KV heads, weights %.1f MiB, KV pool %.1f MiB", r,
                 len(plan.kv_heads[r]), s["weight_bytes"] / 2**20, s["kv_bytes"] / 2**20)
    _self_check(runner, reference)
    return runner


def _self_check(runner, reference) -> float:
    """The group's forward of the self-check tokens against the whole model's reference logits.

    Raises:
        TensorParallelError: the difference passes the self-check's tolerance (the ranks are closed first)."""
    import numpy as np

    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow

    ids = [(i * 7919 + 11) % min(runner.vocab_size, 32000) for i in range(CHECK_IDS)]
    kv = runner.allocate(CHECK_IDS)
    try:
        got = runner.forward([ForwardRow(kv, ids, 0, "all")])[0]
    finally:
        runner.free(kv)
    diff = float(np.abs(got - reference).max())
    tolerance = (1e-3 if runner.dtype == torch.float32 else 5e-2) * max(1.0, float(np.abs(reference).max()))
    if not diff <= tolerance:
        runner.parallel.close()
        raise TensorParallelError(f"tensor parallel: the sharded forward differs from the whole model by {diff:.3g} "
                                  f"(tolerance {tolerance:.3g}); this target's layout is not supported")
    log.info("tensor parallel self-check: max |logit difference| %.2g against the whole model", diff)
    return diff
