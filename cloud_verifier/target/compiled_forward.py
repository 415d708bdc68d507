"""Optional compiled execution of the target runner's forward pass: ``torch.compile`` or CUDA graphs.

The eager forward (:meth:`cloud_verifier.target.runner.TargetRunner.forward`) builds its gather plans in Python inside
the first attention layer (:class:`cloud_verifier.target.attention.PagedBatch`); neither ``torch.compile`` nor a CUDA
graph can hold that. Both modes here build every plan BEFORE the model runs (:func:`freeze`), so that the
decoder + LM head see only tensors:

- ``torch_compile``: ``torch.compile(dynamic=True)`` of decoder + LM head (``torch._dynamo``/Inductor). The
  batch's token count, piece count and key length are symbolic, so new batch sizes and context lengths do not
  recompile (the plan's piece length Q and key-page count are read from tensor shapes, not guarded ints).
- ``cuda_graphs``: one ``torch.cuda.CUDAGraph`` per (rows bucket, tokens per row, key-pages bucket, logits
  kind) for the uniform batches of decode and verify (every row the same length, at most ``PIECE_TOKENS``
  tokens): static input buffers, rows padded to a power of two with rows that write to scratch KV pages
  reserved from the pool, key pages padded (masked) to a power of two (the graph-capture technique of vLLM and
  TensorRT-LLM). Other batches (prefill chunks, mixed lengths) run eagerly. Where CUDA is absent it logs one line
  and runs eagerly.

Measured on a shared 2-core CPU (``python -m specdec.bench.compile_bench --rows 16,64 --tokens 5 --context 300
--layers 2``, SmolLM2-135M cut to 2 layers, float32, torch 2.13): torch.compile is SLOWER than eager - 16 rows:
634 vs 220 ms, 64 rows: 964 vs 494 ms (dynamic shapes; the first pass compiles for 77 s; other row counts and
lengths did not recompile); with ``dynamic=False`` 1075 vs 315 and 1060 vs 516 ms, and a recompilation (about a
minute) for every new shape. So the setting defaults to ``off``; on CUDA it is measured by scripts/gpu_check.sh.
A compiled graph per decoder layer would compile once for all layers, but dynamo specialises it on the layer
index (one graph per layer), hence the one whole-model graph.
"""

from __future__ import annotations

import logging

import torch

from specdec_runtime.cloud_verifier.target.attention import PIECE_TOKENS, PagedBatch

log = logging.getLogger(__name__)
COMPILE_MODES = ("off", "torch_compile", "cuda_graphs")


class FrozenBatch(PagedBatch):
    """A :class:`PagedBatch` whose plans are all built: :meth:`plan` is a lookup, and its Q and key-page count
    come from the tensors' shapes (symbolic under ``torch.compile``), not from Python ints."""

    def plan(self, window: int | None, group: int, device: torch.device) -> tuple:
        qidx, kidx, mask, oidx = self.plans[(window, group)][:4]
        pieces = mask.shape[0]
        return qidx, kidx, mask, oidx, mask.shape[2] // group, kidx.shape[0] // pieces


def freeze(batch: PagedBatch, plan_keys, device: torch.device) -> FrozenBatch:
    """The batch with the plans of ``plan_keys`` ((window, group) pairs, as the eager forward's first pass
    recorded) built now. ``batch.finish`` must have run."""
    for window, group in plan_keys:
        batch.plan(window, group, device)
    frozen = FrozenBatch(batch.pool, reference=False)
    frozen.rows, frozen.slots, frozen.plans = batch.rows, batch.slots, batch.plans
    return frozen


def _bucket(n: int) -> int:
    """The power of two >= n (graph buckets: rows, key pages)."""
    return 1 << max(0, int(n) - 1).bit_length()


class CompiledForward:
    """Runs decoder + LM head for :class:`~cloud_verifier.target.runner.TargetRunner` in ``mode`` (:data:`COMPILE_MODES`).

    :meth:`run` returns the logits float32 [len(index), vocab_size] of the tokens at ``index`` (flat positions),
    or None when this batch must run eagerly (the caller then does). The first forward pass always runs eagerly:
    it records which (window, group) plans the model's layers ask for.

    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, runner, mode: str, replay_eagerly: bool = False, dynamic: bool = True):
        if mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {mode!r}: use {', '.join(COMPILE_MODES)}")
        self.runner = runner
        self.plan_keys: tuple | None = None
        self.passes = 0  # forward passes run compiled / from a graph
        self.graphs: dict[tuple, _Graph] = {}
        self._scratch: list[int] = []
        self.graph_pool = None  # one CUDA memory pool for all graphs (outputs are copied out at once)
        # replay_eagerly: the cuda_graphs buffers and padding without capture (tests of that logic on the CPU)
        self.replay_eagerly = replay_eagerly
        if mode == "cuda_graphs" and runner.device.type != "cuda" and not replay_eagerly:
            log.warning("compile mode cuda_graphs needs a CUDA device (this runner is on %s): running eagerly",
                        runner.device)
            mode = "off"
        self.mode = mode
        # one graph for decoder + LM head (a per-layer graph is specialised on the layer index: one per layer)
        self._compiled = torch.compile(self._decode, dynamic=dynamic) if mode == "torch_compile" else None

    def _decode(self, input_ids, position_ids, index, batch):  # [1, T], [1, T], [W] -> [W, vocab]
        from specdec_runtime.cloud_verifier.target.architectures import apply_logits_transforms

        r = self.runner
        hidden = r.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                            specdec_batch=batch).last_hidden_state
        return apply_logits_transforms(r.config, r.lm_head(hidden[0].index_select(0, index))).float()

    def record(self, batch: PagedBatch) -> None:
        """After an eager pass: remember the plans its layers built."""
        if self.plan_keys is None and not batch.reference:
            self.plan_keys = tuple(batch.plans)

    def run(self, batch: PagedBatch, input_ids, position_ids, index, rows) -> torch.Tensor | None:
        if self.mode == "off" or self.plan_keys is None or batch.reference:
            return None
        if self.mode == "torch_compile":
            logits = self._compiled(input_ids, position_ids, index, freeze(batch, self.plan_keys, input_ids.device))
        else:
            logits = self._run_graph(batch, input_ids, position_ids, rows)
        self.passes += logits is not None
        return logits

    # ------------------------------------------------------------------ CUDA graphs
    def _scratch_pages(self, n: int) -> list[int]:
        """Pages of the pool kept for padding rows (held for the runner's life)."""
        bs = self.runner.kv_pool.page_size
        need = -(-n // bs) - len(self._scratch)
        if need > 0:
            self._scratch.extend(self.runner.kv_pool.pages.allocate(need))
        return self._scratch

    def _run_graph(self, batch, input_ids, position_ids, rows) -> torch.Tensor | None:
        n = len(rows[0].token_ids)
        kind = rows[0].logits
        if n > PIECE_TOKENS or kind not in ("all", "last") or any(len(r.token_ids) != n or r.logits != kind
                                                                    for r in rows):
            return None
        real = len(rows)
        size = _bucket(real)
        scratch = self._scratch_pages(n)
        padded = PagedBatch(batch.pool)
        padded.rows = batch.rows + [(scratch, real * n + i * n, n, 0) for i in range(size - real)]
        padded.finish(input_ids.device)
        frozen = freeze(padded, self.plan_keys, input_ids.device)
        bs = batch.pool.page_size
        plans = {}
        for key, (qidx, kidx, mask, oidx, q, nb) in frozen.plans.items():
            nbb = _bucket(nb)  # padding key pages: repeat the first, masked out
            kidx = kidx.view(size, nb)
            kidx = torch.cat([kidx, kidx[:, :1].expand(size, nbb - nb)], 1).reshape(-1)
            mask = torch.nn.functional.pad(mask, (0, (nbb - nb) * bs), value=False)
            plans[key] = (qidx, kidx, mask, oidx, q, nbb)
        pad_ids = torch.zeros(1, (size - real) * n, dtype=input_ids.dtype, device=input_ids.device)
        pad_pos = torch.arange(n, device=input_ids.device).repeat(size - real).view(1, -1)
        ids = torch.cat([input_ids, pad_ids], 1)
        pos = torch.cat([position_ids, pad_pos], 1)
        per_row = n if kind == "all" else 1
        index = torch.arange(size * n, device=ids.device).view(size, n)[:, n - per_row:].reshape(-1)
        key = (size, n, kind, tuple((k, p[5]) for k, p in sorted(plans.items(), key=str)))
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self.graphs[key] = _Graph(self, ids, pos, index, frozen.slots, plans, self.replay_eagerly)
            except RuntimeError as exc:  # an op the capture refuses: eager from now on, said once
                log.warning("CUDA graph capture failed (%s): running eagerly", str(exc).splitlines()[0])
                self.mode = "off"
                return None
        return graph.replay(ids, pos, frozen.slots, plans)[: real * per_row].clone()  # the buffer is reused


class _Graph:
    """One captured decode/verify shape: static input buffers, the graph, and its output buffer."""

    def __init__(self, owner: CompiledForward, ids, pos, index, slots, plans, replay_eagerly: bool):
        self.ids, self.pos, self.index, self.slots = ids.clone(), pos.clone(), index.clone(), slots.clone()
        self.plans = {k: tuple(t.clone() if torch.is_tensor(t) else t for t in p) for k, p in plans.items()}
        self.batch = FrozenBatch(owner.runner.kv_pool)
        self.batch.slots, self.batch.plans = self.slots, self.plans
        self.fn = lambda: owner._decode(self.ids, self.pos, self.index, self.batch)
        self.graph = None
        if replay_eagerly:
            return
        stream = torch.cuda.Stream()  # warm-up off the default stream, as torch.cuda.graphs' docs ask
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        if owner.graph_pool is None:
            owner.graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(self.graph, pool=owner.graph_pool):
            self.out = self.fn()

    def replay(self, ids, pos, slots, plans) -> torch.Tensor:
        """Copy this batch into the static buffers and run the graph; the output buffer (a view: read it before
        the next replay)."""
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.slots.copy_(slots)
        for key, plan in plans.items():
            for dst, src in zip(self.plans[key][:4], plan[:4]):
                dst.copy_(src)
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out
