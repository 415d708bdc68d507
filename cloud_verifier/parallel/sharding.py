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

Supported module layout: every decoder layer has ``self_attn.{q,k,v}_proj`` and ``o_proj`` (or ``out_proj``)
linears, or LFM2's short convolution, and ``mlp.{gate,up,down}_proj`` (or LFM2's ``feed_forward.{w1,w3,w2}``)
linears (Llama, Mistral, Qwen2/3, Granite, Gemma, SmolLM, LFM2, ...). Fused projections (Phi-3) and the other
hybrid (recurrent) families are refused. Biases of column-parallel linears are sliced with their rows; the bias
of a row-parallel linear is added once, after the all-reduce.

Hybrid targets (LFM2): a short-conv layer is cut along its hidden channels, the same way as heads: ``in_proj``
column-parallel (this rank's channels of B, C and x), the depthwise conv per channel, ``out_proj`` row-parallel,
one all-reduce. Every channel's conv state depends on that channel alone, so each rank's recurrent state (a
session's conv state [1, channels / N, kernel]) holds its own channels and needs no other rank's; it moves with
the rows rank 0 broadcasts (:mod:`cloud_verifier.parallel.step`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F



class TensorParallelError(ValueError):
    """A target or setting the tensor-parallel verifier cannot run (one line)."""


@dataclass(frozen=True)
class ShardPlan:
    """Which heads and MLP features each rank holds.

    ``kv_heads[r]``: the KV heads of rank r (ids in the full model); ``q_heads[r]``: its query heads;
    ``mlp[r]``: (first, end) intermediate features of ``config.intermediate_size`` (:func:`shard_model` cuts each
    layer's own MLP width the same way: LFM2's differs from the config's).
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


# (module, column-parallel input linears, row-parallel output linear) of the MLPs and attentions this cuts
MLP_LAYOUTS = (("mlp", ("gate_proj", "up_proj"), "down_proj"), ("feed_forward", ("w1", "w3"), "w2"))
ATTN_LAYOUTS = (("self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"), ("self_attn", ("q_proj", "k_proj", "v_proj"), "out_proj"))
# recurrent mixers cut along their channels: LFM2's short convolution (in_proj -> B, C, x of hidden channels
# each, a depthwise conv, out_proj): every channel's conv state is independent of the others
CONV_MIXERS = ("Lfm2ShortConv",)


def _layout(module, layouts) -> tuple | None:
    for name, columns, row in layouts:
        part = getattr(module, name, None)
        if part is not None and all(isinstance(getattr(part, n, None), torch.nn.Linear) for n in (*columns, row)):
            return part, columns, row
    return None


def _mixer(layer):
    """The layer's token mixer and its kind: ("attention", module) or ("conv", module); None when unsupported."""
    attn = _layout(layer, ATTN_LAYOUTS)
    if attn is not None:
        return "attention", attn
    conv = getattr(layer, "conv", None)
    if type(conv).__name__ in CONV_MIXERS:
        return "conv", conv
    return None


def check_layout(model) -> None:
    """Raises TensorParallelError when a decoder layer lacks the separate projections this sharding cuts."""
    for i, layer in enumerate(model.get_decoder().layers):
        missing = [] if _mixer(layer) is not None else ["self_attn.{q,k,v,o}_proj or an LFM2 short conv"]
        missing += [] if _layout(layer, MLP_LAYOUTS) is not None else ["mlp.{gate,up,down}_proj"]
        if missing:
            raise TensorParallelError(
                f"tensor parallel: layer {i} of {type(model).__name__} has no {', '.join(missing)} "
                "(supported: separate q/k/v/o and gate/up/down projections, e.g. Llama, Mistral, Qwen2/3, LFM2)")


def _row_parallel(lin: torch.nn.Linear, columns: torch.Tensor, group, timer: AllReduceTimer) -> RowParallelLinear:
    """A :class:`RowParallelLinear` of the input ``columns`` of ``lin`` (the bias kept whole, added once)."""
    weight = lin.weight.detach().index_select(1, columns.to(lin.weight.device)).clone()
    return RowParallelLinear(weight, None if lin.bias is None else lin.bias.detach().clone(), group, timer)


def _shard_attention(found, plan: ShardPlan, rank: int, head_dim: int, group, timer) -> None:
    attn, (q, k, v), o = found
    q_rows = _head_rows(plan.q_heads[rank], head_dim)
    kv_rows = _head_rows(plan.kv_heads[rank], head_dim)
    _rows(getattr(attn, q), q_rows.to(getattr(attn, q).weight.device))
    for name in (k, v):
        _rows(getattr(attn, name), kv_rows.to(getattr(attn, name).weight.device))
    attn.num_key_value_groups = len(plan.q_heads[rank]) // len(plan.kv_heads[rank])
    setattr(attn, o, _row_parallel(getattr(attn, o), q_rows, group, timer))


def _shard_conv(conv, rank: int, world_size: int, group, timer) -> None:
    """LFM2's short conv: this rank's channels of B, C and x (in_proj rows), of the depthwise conv (its state
    [1, channels, kernel] then holds these channels only) and of out_proj's input (row-parallel)."""
    hidden = conv.out_proj.in_features
    lo, hi = _even_cuts(hidden, world_size)[rank]
    channels = torch.arange(lo, hi, dtype=torch.long)
    _rows(conv.in_proj, torch.cat([channels + part * hidden for part in range(3)]).to(conv.in_proj.weight.device))
    w = conv.conv.weight  # [hidden, 1, kernel]: depthwise
    conv.conv.weight = torch.nn.Parameter(w.detach()[lo:hi].clone(), requires_grad=False)
    if conv.conv.bias is not None:
        conv.conv.bias = torch.nn.Parameter(conv.conv.bias.detach()[lo:hi].clone(), requires_grad=False)
    conv.conv.in_channels = conv.conv.out_channels = conv.conv.groups = hi - lo
    conv.out_proj = _row_parallel(conv.out_proj, channels, group, timer)


def _shard_mlp(found, rank: int, world_size: int, group, timer) -> None:
    mlp, columns, row = found
    lo, hi = _even_cuts(getattr(mlp, columns[0]).out_features, world_size)[rank]
    features = torch.arange(lo, hi, dtype=torch.long)
    for name in columns:
        _rows(getattr(mlp, name), features.to(getattr(mlp, name).weight.device))
    setattr(mlp, row, _row_parallel(getattr(mlp, row), features, group, timer))


@torch.no_grad()
def shard_model(model, plan: ShardPlan, rank: int, group, timer: AllReduceTimer) -> None:
    """Cut ``model``'s decoder layers in place to rank ``rank``'s shard of ``plan``: column-parallel q/k/v and
    gate/up (LFM2: w1/w3), :class:`RowParallelLinear` o_proj (LFM2: out_proj) and down_proj (w2) on ``group``;
    LFM2's short convolutions split along their channels (in_proj column-parallel, the depthwise conv and its
    state per channel, out_proj row-parallel). The MLP features are cut from each layer's own linear sizes.
    Frees the cut-away weights.

    Raises:
        TensorParallelError: the layout is not supported (:func:`check_layout`).
    """
    check_layout(model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for layer in model.get_decoder().layers:
        kind, found = _mixer(layer)
        if kind == "attention":
            _shard_attention(found, plan, rank, head_dim, group, timer)
        else:
            _shard_conv(found, rank, plan.world_size, group, timer)
        _shard_mlp(_layout(layer, MLP_LAYOUTS), rank, plan.world_size, group, timer)


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers held by this process (a tied weight counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
