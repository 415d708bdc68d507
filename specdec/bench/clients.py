"""Concurrent edge clients against ONE verifier on loopback gRPC (:func:`run_clients_bench`): batched verification
vs the same verifier verifying one block per forward pass."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ._shared import (WARMUP_NEW_TOKENS, progress_bar, safe_ratio, resolve_dirs, current_target_placement, threading_config,
                      package_versions)
from .prompts import BenchPrompt, load_prompts
from specdec_runtime.common.types import DEFAULT_DRAFT_TOP_K

CLIENTS_DEFAULT_LIMIT = 8  # prompts of run_clients_bench when no limit is given (keeps the run bounded)


class _RecordingBackend:
    """Wraps a VerifierBackend and records the batch size of every verdict (one per verify step)."""

    def __init__(self, inner):
        self.inner = inner
        self.batch_sizes: list[int] = []
        self._lock = threading.Lock()

    def open_session(self, *args, **kwargs):
        return self.inner.open_session(*args, **kwargs)

    def submit(self, session_id, seq, committed_length, block) -> Future:
        fut = self.inner.submit(session_id, seq, committed_length, block)

        def done(f: Future) -> None:
            if not f.cancelled() and f.exception() is None:
                with self._lock:
                    self.batch_sizes.append(int(f.result().batch_size))

        fut.add_done_callback(done)
        return fut

    def close_session(self, session_id):
        return self.inner.close_session(session_id)

    def close(self):
        return self.inner.close()

    def take(self) -> list[int]:
        with self._lock:
            out, self.batch_sizes = self.batch_sizes, []
        return out


def _assign(n_items: int, n_clients: int) -> list[list[int]]:
    """Prompt indices per client: round-robin; when prompts < clients, client j gets prompt j mod n."""
    if n_items >= n_clients:
        return [list(range(j, n_items, n_clients)) for j in range(n_clients)]
    return [[j % n_items] for j in range(n_clients)]


def run_clients_bench(
    prompts: Path,
    client_counts: list[int],
    *,
    limit: int | None = None,
    max_new_tokens: int = 128,
    num_speculative_tokens: int = 4,
    target: Path | None = None,
    draft: Path | None = None,
    progress: bool = False,
    client_drafter: str = "model",
    max_batch_size: int = 32,
    rounds: int = 1,
    warmup_pass: bool = True,
) -> dict:
    """N concurrent edge clients against ONE verifier on loopback gRPC: batched vs one block per forward pass.

    For each N in ``client_counts``: N threads, each an EdgeClient with its own ONNX draft session
    (``client_drafter="model"``) or no drafter (``"none"``: target-only, empty blocks) and its own GrpcBackend,
    generate greedily for their share of the prompts (round-robin; when prompts < N, every client still gets
    one). After an untimed short warm-up pass (``warmup_pass``), each of ``rounds`` rounds runs the pass twice
    on the same server, once batched (``max_batch_size``) and once serial (``max_batch_size=1``), the order
    alternating from round to round; rates are summed over rounds (ratios of sums). Run time grows with
    sum over N of (1 + 2·rounds) passes of max(prompts, N) generations of up to ``max_new_tokens`` tokens.

    Returns ``{"clients": {"N": {"tokens_per_s", "per_session_tokens_per_s", "mean_batch_size",
    "speedup_vs_serial", "serial": {...}, ...}}, "config": {...}, "notes": [...]}``.
    """
    counts = _check_clients_args(client_counts, rounds, client_drafter, max_new_tokens, num_speculative_tokens)
    notes: list[str] = []
    if limit is None:
        limit = max(CLIENTS_DEFAULT_LIMIT, max(counts))
        notes.append(f"no --limit: {limit} prompts (round-robin across categories) to keep the run bounded")
    questions = load_prompts(prompts, limit)
    target_dir, draft_dir = resolve_dirs(target, draft)
    cpus = os.cpu_count() or 1
    notes.append(
        f"all edge clients and the verifier share this machine's {cpus} CPU cores: with N drafting clients the "
        "drafts compete with the target for CPU, so batching gains here understate a real deployment (drafts on "
        "the devices, target on an accelerator); client_drafter='none' isolates the verifier's batching"
    )
    draft_threads = max(1, cpus // max(counts))
    notes.append(f"each client's ONNX draft session uses {draft_threads} intra-op thread(s) (cores // max N)")
    rig = _ClientsRig(target_dir, draft_dir, questions, max_batch_size=max_batch_size,
                      max_sessions=max(256, 2 * max(counts)), draft_threads=draft_threads,
                      client_drafter=client_drafter, num_speculative_tokens=num_speculative_tokens)
    report: dict[str, dict] = {}
    t0 = time.perf_counter()
    bar = None
    try:
        bar = progress_bar(progress, 2 * rounds * len(counts), "clients bench", "pass")
        for i, n in enumerate(counts):
            report[str(n)] = _measure_client_count(
                rig, n, max_batch_size=max_batch_size, rounds=rounds, first_round=i * rounds,
                warmup_pass=warmup_pass, max_new_tokens=max_new_tokens, bar=bar, notes=notes,
            )
    finally:
        if bar is not None:
            bar.close()
        rig.close()
    config = _clients_config(prompts, limit, questions, rig, t0, max_new_tokens=max_new_tokens,
                             num_speculative_tokens=num_speculative_tokens, client_drafter=client_drafter,
                             max_batch_size=max_batch_size, rounds=rounds, warmup_pass=warmup_pass,
                             target_dir=target_dir, draft_dir=draft_dir, cpus=cpus)
    notes.append(
        "tokens_per_s = committed tokens of all sessions / wall time of the pass; per_session_tokens_per_s = "
        "tokens / summed session time; mean_batch_size = mean Verdict.batch_size over verify steps"
    )
    notes.append(
        "acceptance can differ a little between client counts for the same prompts: each client's draft KV cache "
        "is reused across its sessions, and the int8 ONNX draft's logits depend slightly on how its cache was "
        "built (whole chunk vs token by token); the verifier's output does not"
    )
    return {"clients": report, "config": config, "notes": notes}


def _clients_config(prompts: Path, limit: int, questions: list[BenchPrompt], rig: _ClientsRig, t0: float, *,
                    max_new_tokens: int, num_speculative_tokens: int, client_drafter: str, max_batch_size: int,
                    rounds: int, warmup_pass: bool, target_dir: Path, draft_dir: Path, cpus: int) -> dict:
    return {
        "prompts": str(Path(prompts).expanduser()),
        "limit": limit,
        "num_prompts": len(questions),
        "max_new_tokens": max_new_tokens,
        "num_speculative_tokens": num_speculative_tokens,
        "client_drafter": client_drafter,
        "max_batch_size": max_batch_size,
        "max_batch_wait_ms": rig.verifier.max_batch_wait_s * 1000,
        "rounds": rounds,
        "warmup_pass": warmup_pass,
        "decoding": "greedy",
        "transport": "gRPC on loopback (EmbeddedServer), one GrpcBackend per client",
        "target": str(target_dir),
        "draft": str(draft_dir),
        "cpu_count": cpus,
        "threading": threading_config(),
        "versions": package_versions(),
        "run_s": round(time.perf_counter() - t0, 2),
    }


def _check_clients_args(client_counts: list[int], rounds: int, client_drafter: str, max_new_tokens: int,
                        num_speculative_tokens: int) -> list[int]:
    """The unique client counts, in the given order. Raises InvalidRequestError on any invalid argument."""
    from specdec_runtime.common.errors import InvalidRequestError

    counts = list(dict.fromkeys(int(c) for c in client_counts))
    if rounds < 1:
        raise InvalidRequestError(f"rounds must be >= 1, got {rounds}")
    if not counts or min(counts) < 1:
        raise InvalidRequestError(f"client counts must be >= 1, got {client_counts}")
    if client_drafter not in ("model", "none"):
        raise InvalidRequestError(f"client_drafter must be 'model' or 'none', got {client_drafter!r}")
    if max_new_tokens < 1 or num_speculative_tokens < 1:
        raise InvalidRequestError("max_new_tokens and num_speculative_tokens must be >= 1")
    return counts


# A pass: (GenerationResults in share order, wall s, Verdict batch sizes).
_Pass = tuple[list, float, list[int]]


class _ClientsRig:
    """ONE verifier behind an EmbeddedServer (loopback gRPC) and a pool of edge clients that grows on demand, each
    with its own ONNX draft session (or none: ``client_drafter="none"``) and its own GrpcBackend."""

    def __init__(self, target_dir: Path, draft_dir: Path, questions: list[BenchPrompt], *, max_batch_size: int,
                 max_sessions: int, draft_threads: int, client_drafter: str, num_speculative_tokens: int):
        from specdec_runtime.cloud_verifier.target.runner import TargetRunner
        from specdec_runtime.cloud_verifier.verifier import Verifier
        from specdec.embedded import EmbeddedServer

        self.draft_dir = draft_dir
        self.questions = questions
        self.draft_threads = draft_threads
        self.client_drafter = client_drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.runner = TargetRunner(target_dir, **current_target_placement())
        self.verifier = Verifier(self.runner, max_batch_size=max_batch_size, max_sessions=max_sessions)
        self.server = EmbeddedServer(verifier=self.verifier)
        self.address = self.server.start()
        self.pool: list[tuple[Any, _RecordingBackend]] = []
        self.valid: int | None = None
        self.encoded: list[list[int]] = []  # the questions' prompt ids (chat template), set by the first client

    def grow(self, n: int, max_new_tokens: int) -> None:
        """At least ``n`` clients in the pool, each warmed up with one short generation."""
        while len(self.pool) < n:
            self.pool.append(self._new_client(max_new_tokens))

    def _new_client(self, max_new_tokens: int) -> tuple[Any, _RecordingBackend]:
        from specdec_runtime.common.vocab import check_vocab_compatible
        from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
        from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
        from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
        from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

        model = OnnxDraftModel(self.draft_dir, intra_op_num_threads=self.draft_threads)
        if self.valid is None:
            runner = self.runner
            self.valid = check_vocab_compatible(model.tokenizer, runner.tokenizer, model.vocab_size, runner.vocab_size)
            self.encoded = [encode_prompt(model.tokenizer, q.prompt, chat=True) for q in self.questions]
        rec = _RecordingBackend(GrpcBackend(self.address))
        drafter = (ModelDrafter(model, draft_top_k=DEFAULT_DRAFT_TOP_K, valid_vocab_size=self.valid)
                   if self.client_drafter == "model" else None)
        c = EdgeClient(rec, drafter, model.tokenizer, num_speculative_tokens=self.num_speculative_tokens)
        c.generate(self.encoded[0], max_new_tokens=min(WARMUP_NEW_TOKENS, max_new_tokens), temperature=0.0)  # warm-up
        rec.take()
        return c, rec

    def run_pass(self, n: int, batch: int, n_new: int) -> _Pass:
        """All N clients generate their shares concurrently; (results in share order, wall s, batch sizes)."""
        self.verifier.max_batch_size = batch  # read by the batcher before each batch
        shares = _assign(len(self.encoded), n)
        out: list[list] = [[] for _ in range(n)]
        errors: list[BaseException] = []

        def work(j: int) -> None:
            client, _ = self.pool[j]
            try:
                for idx in shares[j]:
                    out[j].append(client.generate(self.encoded[idx], max_new_tokens=n_new, temperature=0.0))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        for _, rec in self.pool[:n]:
            rec.take()
        threads = [threading.Thread(target=work, args=(j,), name=f"bench-client-{j}") for j in range(n)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t
        if errors:
            raise errors[0]
        return [r for rs in out for r in rs], wall, [b for _, rec in self.pool[:n] for b in rec.take()]

    def close(self) -> None:
        for c, _ in self.pool:
            with contextlib.suppress(Exception):
                c.close()
        with contextlib.suppress(Exception):
            self.server.stop()
        with contextlib.suppress(Exception):
            self.verifier.shutdown()


def _measure_client_count(rig: _ClientsRig, n: int, *, max_batch_size: int, rounds: int, first_round: int,
                          warmup_pass: bool, max_new_tokens: int, bar: Any, notes: list[str]) -> dict:
    """The report entry of N clients: ``rounds`` batched and serial passes, their order alternating from round to
    round (``first_round`` = rounds run before, over every N), after an untimed short warm-up pass."""
    rig.grow(n, max_new_tokens)
    if warmup_pass:  # untimed, short: every prompt's prefill shape, every client's channel and session
        rig.run_pass(n, max_batch_size, min(WARMUP_NEW_TOKENS, max_new_tokens))
    passes: dict[int, list[_Pass]] = {max_batch_size: [], 1: []}
    for k in range(first_round, first_round + rounds):
        order = [max_batch_size, 1] if k % 2 == 0 else [1, max_batch_size]
        for b in order:
            passes[b].append(rig.run_pass(n, b, max_new_tokens))
            if bar is not None:
                bar.set_postfix_str(f"N={n} batch≤{b}", refresh=False)
                bar.update(1)
    ids_b = [[r.token_ids for r in p[0]] for p in passes[max_batch_size]]
    ids_s = [[r.token_ids for r in p[0]] for p in passes[1]]
    same = all(x == ids_b[0] for x in ids_b + ids_s)
    if not same:
        notes.append(f"N={n}: greedy outputs differ between passes (batched vs serial; must be identical)")
    batched, serial = _pass_metrics(passes[max_batch_size]), _pass_metrics(passes[1])
    return {
        **batched,
        "speedup_vs_serial": safe_ratio(batched["tokens_per_s"] or 0, serial["tokens_per_s"] or 0),
        "greedy_identical_to_serial": same,
        "serial": serial,
    }


def _pass_metrics(passes: list[_Pass]) -> dict:
    """Rates over several passes (ratios of sums)."""
    results = [r for p in passes for r in p[0]]
    wall = sum(p[1] for p in passes)
    sizes = [b for p in passes for b in p[2]]
    tokens = sum(len(r.token_ids) for r in results)
    steps = sum(r.stats.num_drafts for r in results)
    drafted = sum(r.stats.num_draft_tokens for r in results)
    accepted = sum(r.stats.num_accepted_tokens for r in results)
    return {
        "tokens_per_s": safe_ratio(tokens, wall),
        "per_session_tokens_per_s": safe_ratio(tokens, sum(r.stats.elapsed_s for r in results)),
        "mean_batch_size": safe_ratio(sum(sizes), len(sizes)),
        "num_sessions": len(results),
        "num_tokens": tokens,
        "wall_s": wall,
        "wall_s_per_round": [round(p[1], 3) for p in passes],
        "acceptance_rate": safe_ratio(accepted, drafted),
        "mean_accepted_length": 1.0 + accepted / steps if steps else None,
    }
