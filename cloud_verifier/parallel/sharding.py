"""Megatron-style tensor-parallel sharding of the target's decoder layers on torch.distributed.

Following Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (section 3): in every decoder layer

- attention: ``q_proj``, ``k_proj``, ``v_proj`` are column-parallel (each rank keeps the output rows of its own
  query and KV heads), ``o_proj`` is row-parallel (the input columns of its query heads), followed by ONE
  ``torch.distributed.all_reduce`` (sum) of the partial outputs;
- MLP: ``gate_proj`` and ``up_proj`` column-parallel (a slice of the intermediate features), ``down_proj``
  row-parallel, followed by one all-reduce.

Embeddings, norms and the LM head stay replicated (the LM head runs on rank 0 only: logits are needed there
only). Heads are split along KV groups: the query heads of one KV head stay on the rank that holds it, so the
attention of a rank needs no other rank's keys. With ``num_kv_heads >= N`` the KV heads are cut into N contiguous
parts as evenly as possible (the default SmolLM2-135M target has 9 query / 3 KV heads: at N = 2 rank 0 holds 2
KV heads and rank 1 one; an uneven split costs the slower rank's extra head, it is not refused); with fewer KV
heads than ranks each KV head is replicated on ``N / num_kv_heads`` ranks, which split its query heads (vLLM's
rule). Anything else is refused in one line by :func:`plan_shards`.

Supported module layout: every decoder layer has ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``
linears (Llama, Mistral, Qwen2/3, Granite, Gemma, SmolLM, ...). Fused projections (Phi-3) and hybrid
(recurrent) targets are refused. Biases of column-parallel linears are sliced with their rows; the bias of a
row-parallel linear is added once, after the all-reduce.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class TensorParallelError(ValueError):
    """A target or setting the tensor-parallel verifier cannot run (one line)."""


@dataclass(frozen=True)
class ShardPlan:
    """Which heads and MLP features each rank holds.

    ``kv_heads[r]``: the KV heads of rank r (ids in the full model); ``q_heads[r]``: its query heads;
    ``mlp[r]``: (first, end) intermediate features.
    """

    world_size: int
    kv_heads: tuple[tuple[int, ...], ...]
    q_heads: tuple[tuple[int, ...], ...]
    mlp: tuple[tuple[int, int], ...]


def _even_cuts(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering 0..total-1, sizes differing by at most one (larger first)."""
    base, extra = divmod(total, parts)
    cuts, lo = [], 0
    for r in range(parts):
        hi = lo + base + (1 if r < extra else 0)
        cuts.append((lo, hi))
        lo = hi
    return cuts


def plan_shards(config, world_size: int) -> ShardPlan:
    """The head and MLP split of ``config`` (an HF config) over ``world_size`` ranks.

    Raises:
        TensorParallelError: ``world_size`` < 1; more ranks than query heads or MLP features; fewer KV heads
            than ranks where ``world_size`` is not a multiple of the KV-head count or a KV head's query heads
            do not split evenly over its ranks (one line naming the counts).
    """
    n = int(world_size)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    inter = int(config.intermediate_size)
    name = f"target with {heads} query / {kv} KV heads"
    if n < 1:
        raise TensorParallelError(f"tensor parallel size must be at least 1, not {n}")
    if n > heads or n > inter:
        raise TensorParallelError(f"tensor parallel {n}: {name} and {inter} MLP features cannot be split {n} ways")
    group = heads // kv
    if kv >= n:
        kv_heads = [tuple(range(lo, hi)) for lo, hi in _even_cuts(kv, n)]
        q_heads = [tuple(q for k in ks for q in range(k * group, (k + 1) * group)) for ks in kv_heads]
    else:
        if n % kv or group % (n // kv):
            raise TensorParallelError(
                f"tensor parallel {n}: {name} cannot be split {n} ways (the query heads of a KV head must split "
                f"evenly over the ranks that share it: use a size up to {kv}, or a multiple of {kv} dividing {heads})")
        per_kv = n // kv
        kv_heads, q_heads = [], []
        for r in range(n):
            k, part = divmod(r, per_kv)
            lo = k * group + part * (group // per_kv)
            kv_heads.append((k,))
            q_heads.append(tuple(range(lo, lo + group // per_kv)))
    return ShardPlan(n, tuple(kv_heads), tuple(q_heads), tuple(_even_cuts(inter, n)))


@dataclass
class AllReduceTimer:
    """Wall time of the row-parallel all-reduces: ``seconds`` since the last :meth:`take` (rank 0 takes it after
    each forward pass), ``total_seconds`` and ``calls`` since the start. On CUDA it measures the host side of the
    call (NCCL runs asynchronously on the stream)."""

    seconds: float = 0.0
    calls: int = 0
    total_seconds: float = 0.0

    def take(self) -> float:
        """The seconds since the last call, and reset them."""
        s, self.seconds = self.seconds, 0.0
        return s


class RowParallelLinear(torch.nn.Module):
    """A row-parallel linear: this rank's input columns of the weight; the partial outputs of all ranks are
    summed with one ``torch.distributed.all_reduce``, then the bias (held whole) is added once.

    Input [..., in_features / N] (this rank's part); output [..., out_features], identical on every rank."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, timer: AllReduceTimer):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.group = group
        self.timer = timer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        start = time.perf_counter()
        dist.all_reduce(y, group=self.group)
        elapsed = time.perf_counter() - start
        self.timer.seconds += elapsed
        self.timer.total_seconds += elapsed
        self.timer.calls += 1
        return y if self.bias is None else y + self.bias


def _rows(lin: torch.nn.Linear, index: torch.Tensor) -> None:
    """Keep the output rows ``index`` of a linear (column-parallel), its bias too."""
    lin.weight = torch.nn.Parameter(lin.weight.detach().index_select(0, index).clone(), requires_grad=False)
    if lin.bias is not None:
        lin.bias = torch.nn.Parameter(lin.bias.detach().index_select(0, index).clone(), requires_grad=False)
    lin.out_features = int(index.numel())


def _head_rows(heads: tuple[int, ...], head_dim: int) -> torch.Tensor:
    return torch.tensor([h * head_dim + i for h in heads for i in range(head_dim)], dtype=torch.long)


def check_layout(model) -> None:
    """Raises TensorParallelError when a decoder layer lacks the separate projections this sharding cuts."""
    for i, layer in enumerate(model.get_decoder().layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        missing = [f"self_attn.{p}" for p in ATTN_PROJECTIONS if not isinstance(getattr(attn, p, None), torch.nn.Linear)]
        missing += [f"mlp.{p}" for p in MLP_PROJECTIONS if not isinstance(getattr(mlp, p, None), torch.nn.Linear)]
        if missing:
            raise TensorParallelError(
                f"tensor parallel: layer {i} of {type(model).__name__} has no {', '.join(missing)} "
                "(supported: separate q/k/v/o and gate/up/down projections, e.g. Llama, Mistral, Qwen2/3)")


@torch.no_grad()
def shard_model(model, plan: ShardPlan, rank: int, group, timer: AllReduceTimer) -> None:
    """Cut ``model``'s decoder layers in place to rank ``rank``'s shard of ``plan`` (column-parallel q/k/v and
    gate/up, :class:`RowParallelLinear` o_proj and down_proj on ``group``). Frees the cut-away weights.

    Raises:
        TensorParallelError: the layout is not supported (:func:`check_layout`).
    """
    check_layout(model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q_rows = _head_rows(plan.q_heads[rank], head_dim)
    kv_rows = _head_rows(plan.kv_heads[rank], head_dim)
    lo, hi = plan.mlp[rank]
    mlp_rows = torch.arange(lo, hi, dtype=torch.long)
    for layer in model.get_decoder().layers:
        attn, mlp = layer.self_attn, layer.mlp
        _rows(attn.q_proj, q_rows.to(attn.q_proj.weight.device))
        _rows(attn.k_proj, kv_rows.to(attn.k_proj.weight.device))
        _rows(attn.v_proj, kv_rows.to(attn.v_proj.weight.device))
        attn.num_key_value_groups = len(plan.q_heads[rank]) // len(plan.kv_heads[rank])
        o = attn.o_proj
        attn.o_proj = RowParallelLinear(o.weight.detach().index_select(1, q_rows.to(o.weight.device)).clone(),
                                        None if o.bias is None else o.bias.detach().clone(), group, timer)
        _rows(mlp.gate_proj, mlp_rows.to(mlp.gate_proj.weight.device))
        _rows(mlp.up_proj, mlp_rows.to(mlp.up_proj.weight.device))
        d = mlp.down_proj
        mlp.down_proj = RowParallelLinear(d.weight.detach()[:, lo:hi].clone(),
                                          None if d.bias is None else d.bias.detach().clone(), group, timer)


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers held by this process (a tied weight counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
