"""The draft head as a torch module with the device's ONNX signature (:class:`HeadGraph`), and its export.

One decoder layer conditioned on the target's features (Li et al. 2024, "EAGLE"; Li et al. 2025, "EAGLE-3"):

- EAGLE-3: ``x = [input_layernorm(embed(token)), hidden_norm(feature)]`` (2H wide into q/k/v), residual =
  feature; then the MLP; logits = lm_head(norm(h)) over the reduced draft vocabulary.
- EAGLE-1: ``x = fc([embed(token), feature])`` (2H → H, with bias), residual = x, no input norm (the layer is
  the head's first); logits = the target's lm_head(h) over the full vocabulary.

``h`` (pre-norm, [T, H]) is the head's own next feature. The target's EAGLE-3 features (three layers
concatenated, 3H) go through the head's ``fc`` first: exported as its own small graph (``fuse.onnx``) so the
head graph always takes H-wide features, the verifier's fused or the head's own.

ONNX signature of ``head.onnx`` (batch 1): inputs ``input_ids`` int64 [1, T], ``features`` float32 [1, T, H],
``position_ids`` int64 [1, T], ``past_key`` / ``past_value`` float32 [1, kv_heads, P, head_dim]; outputs
``logits`` float32 [1, T, draft_vocab], ``hidden`` float32 [1, T, H], ``present_key`` / ``present_value``
[1, kv_heads, P + T, head_dim]. Rotary embeddings as Llama's (``rope_theta``; rope scaling is not applied: it
changes acceptance only, never the output). The embedding is stored in float16 (the graph's largest tensor,
[V, H]; the rows it gathers are cast to float32), so training uses the same rounded rows
(:mod:`specdec.distill.head_training`).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
from torch import nn

__all__ = ["HeadGraph", "export_head_onnx", "export_fuse_onnx"]

OPSET = 17


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HeadGraph(nn.Module):
    """The head's one step over T tokens (see the module docstring). ``weights``: name → tensor, the names of
    the EAGLE checkpoints without their layer prefix (``self_attn.q_proj.weight``, ``mlp.gate_proj.weight``,
    ``post_attention_layernorm.weight``; EAGLE-3: ``input_layernorm.weight``, ``hidden_norm.weight``,
    ``norm.weight``; EAGLE-1: ``fc.weight``, ``fc.bias``), plus ``embed`` [V, H] and ``lm_head`` [Vd, H]."""

    def __init__(self, kind: str, weights: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, rope_theta: float):
        super().__init__()
        self.kind, self.num_heads, self.num_kv_heads, self.head_dim = kind, num_heads, num_kv_heads, head_dim
        self.eps = float(eps)
        for name, tensor in weights.items():
            # The embedding in float16 halves the device's largest tensor at no step cost: a gather reads T rows.
            # The lm_head is read whole every step, so it stays float32 (a cast per step would cost more).
            dtype = torch.float16 if name == "embed" else torch.float32
            self.register_buffer(name.replace(".", "_"), tensor.detach().to(dtype).contiguous())
        inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv)

    def w(self, name: str) -> torch.Tensor:
        return getattr(self, name.replace(".", "_"))

    def _attention(self, x, position_ids, past_key, past_value):
        t = x.shape[1]
        q = (x @ self.w("self_attn.q_proj.weight").T).view(1, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = (x @ self.w("self_attn.k_proj.weight").T).view(1, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = (x @ self.w("self_attn.v_proj.weight").T).view(1, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        angles = position_ids[0].float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        key = torch.cat((past_key, k), dim=2)
        value = torch.cat((past_value, v), dim=2)
        groups = self.num_heads // self.num_kv_heads
        kk = key.repeat_interleave(groups, dim=1)
        vv = value.repeat_interleave(groups, dim=1)
        scores = (q @ kk.transpose(2, 3)) / math.sqrt(self.head_dim)  # [1, heads, T, P + T]
        total = key.shape[2]
        query_pos = torch.arange(t) + (total - t)
        masked = torch.arange(total)[None, :] > query_pos[:, None]
        scores = scores.masked_fill(masked[None, None], float("-inf"))
        out = (scores.softmax(-1) @ vv).transpose(1, 2).reshape(1, t, self.num_heads * self.head_dim)
        return out @ self.w("self_attn.o_proj.weight").T, key, value

    def forward(self, input_ids, features, position_ids, past_key, past_value):
        emb = self.w("embed")[input_ids[0]][None].float()  # [1, T, H]
        if self.kind == "eagle3":
            residual = features
            x = torch.cat((_rms(emb, self.w("input_layernorm.weight"), self.eps),
                           _rms(features, self.w("hidden_norm.weight"), self.eps)), dim=-1)
        else:
            x = torch.cat((emb, features), dim=-1) @ self.w("fc.weight").T + self.w("fc.bias")
            residual = x
        attn, key, value = self._attention(x, position_ids, past_key, past_value)
        h = residual + attn
        m = _rms(h, self.w("post_attention_layernorm.weight"), self.eps)
        gate = m @ self.w("mlp.gate_proj.weight").T
        m = (torch.nn.functional.silu(gate) * (m @ self.w("mlp.up_proj.weight").T)) @ self.w("mlp.down_proj.weight").T
        h = h + m
        out = _rms(h, self.w("norm.weight"), self.eps) if self.kind == "eagle3" else h
        return out @ self.w("lm_head").T, h, key, value


def export_head_onnx(graph: HeadGraph, hidden_size: int, path: Path) -> None:
    """Trace ``graph`` (T = 3, P = 4: no size 0 or 1 to specialise on) to ``path`` with dynamic T and P."""
    t, p = 3, 4
    args = (torch.zeros(1, t, dtype=torch.int64), torch.randn(1, t, hidden_size),
            torch.arange(p, p + t)[None], torch.randn(1, graph.num_kv_heads, p, graph.head_dim),
            torch.randn(1, graph.num_kv_heads, p, graph.head_dim))
    seq = {1: "sequence_length"}
    axes = {"input_ids": seq, "features": seq, "position_ids": seq, "logits": seq, "hidden": seq,
            "past_key": {2: "past_sequence_length"}, "past_value": {2: "past_sequence_length"},
            "present_key": {2: "total_sequence_length"}, "present_value": {2: "total_sequence_length"}}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings about Python-constant shapes are expected
        torch.onnx.export(graph, args, str(path), opset_version=OPSET, do_constant_folding=True, dynamo=False,
                          input_names=["input_ids", "features", "position_ids", "past_key", "past_value"],
                          output_names=["logits", "hidden", "present_key", "present_value"], dynamic_axes=axes)


class _Fuse(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach().float().contiguous())

    def forward(self, target_features):
        return target_features @ self.weight.T


def export_fuse_onnx(fc_weight: torch.Tensor, path: Path) -> None:
    """EAGLE-3's ``fc`` ([H, k·H]) as ``fuse.onnx``: ``target_features`` float32 [N, k·H] → ``features`` [N, H]."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Fuse(fc_weight), (torch.randn(3, fc_weight.shape[1]),), str(path), opset_version=OPSET,
                          dynamo=False, input_names=["target_features"], output_names=["features"],
                          dynamic_axes={"target_features": {0: "n"}, "features": {0: "n"}})
