"""The trainable EAGLE-3 draft head of ``specdec draft train-head`` (:mod:`specdec.distill.head_training`): its
parameters, named as the checkpoints EAGLE-3's authors publish, and its training-time-test forward (Li et al. 2025,
"EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test"), computed as the
device's ONNX head (:mod:`specdec.models.head_graph`) drafts: one decoder layer over [embedding ; fused feature],
rotary positions, grouped-query attention, the final norm and a reduced LM head. Tensors live on the device of the
features they are given (CPU or CUDA); :meth:`TrainableHead.to` moves the parameters.
"""

from __future__ import annotations

import math

__all__ = ["TrainableHead", "init_from_target"]


def _rms(x, w, eps=1e-6):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w


def _rope(x, pos, theta):
    import torch

    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = pos.float()[:, None] * inv[None]
    emb = torch.cat((ang, ang), -1)
    half = d // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * emb.cos() + rot * emb.sin()


class TrainableHead:
    """The trainable EAGLE-3 head (parameters named as the published checkpoints) and its TTT forward."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, inter: int, draft_vocab: int, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        d = hidden // heads
        self.hidden, self.heads, self.kv_heads, self.d = hidden, heads, kv_heads, d

        def p(*shape, scale=0.02):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * scale)
        self.params = {
            "fc.weight": p(hidden, 3 * hidden), "midlayer.self_attn.q_proj.weight": p(heads * d, 2 * hidden),
            "midlayer.self_attn.k_proj.weight": p(kv_heads * d, 2 * hidden),
            "midlayer.self_attn.v_proj.weight": p(kv_heads * d, 2 * hidden),
            "midlayer.self_attn.o_proj.weight": p(hidden, heads * d),
            "midlayer.mlp.gate_proj.weight": p(inter, hidden), "midlayer.mlp.up_proj.weight": p(inter, hidden),
            "midlayer.mlp.down_proj.weight": p(hidden, inter),
            "midlayer.input_layernorm.weight": torch.nn.Parameter(torch.ones(hidden)),
            "midlayer.hidden_norm.weight": torch.nn.Parameter(torch.ones(hidden)),
            "midlayer.post_attention_layernorm.weight": torch.nn.Parameter(torch.ones(hidden)),
            "norm.weight": torch.nn.Parameter(torch.ones(hidden)), "lm_head.weight": p(draft_vocab, hidden)}

    def to(self, device) -> "TrainableHead":
        """Move the parameters to ``device`` (a torch device or its name; they start on the CPU, drawn from a
        seeded CPU generator, so a head starts the same on every device). Returns self."""
        import torch

        self.params = {k: torch.nn.Parameter(v.detach().to(device)) for k, v in self.params.items()}
        return self

    def _qkv(self, emb, feat, pos, theta):
        w = self.params
        x = torch_cat((_rms(emb, w["midlayer.input_layernorm.weight"]), _rms(feat, w["midlayer.hidden_norm.weight"])))
        t = x.shape[0]
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, self.heads, self.d).transpose(0, 1)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, self.kv_heads, self.d).transpose(0, 1)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, self.kv_heads, self.d).transpose(0, 1)
        groups = self.heads // self.kv_heads
        return (_rope(q, pos, theta), _rope(k, pos, theta).repeat_interleave(groups, 0),
                v.repeat_interleave(groups, 0))

    def steps(self, emb_seq, target_features, theta: float, num_steps: int, first: int = 0):
        """The head's logits of each TTT step k for a sequence of L tokens: ``emb_seq`` the target's embeddings
        [L, H], ``target_features`` [L - 1, k·H] (positions 0 .. L-2), so n = L - 1 entries. Only entries from
        ``first`` on are drafted from (earlier ones are attended to as context): a list of (first, logits
        [n - first - k, draft_vocab]) per step k; row r is entry first + r fed token x_{first+r+1+k}."""
        import torch

        w, n, dev = self.params, target_features.shape[0], target_features.device
        first = min(max(int(first), 0), n - 1)
        fused = target_features @ w["fc.weight"].T
        q0, k0, v0 = self._qkv(emb_seq[1: 1 + n], fused, torch.arange(n, device=dev), theta)
        keys, values, outs, feat = [k0], [v0], [], fused[first:]
        scale = 1.0 / math.sqrt(self.d)
        for k in range(num_steps):
            m = n - first - k  # rows: entries first .. n-1-k
            if m <= 0:
                break
            if k == 0:
                q = q0[:, first:]
            else:
                emb = emb_seq[1 + k + first: 1 + k + first + m]
                q, kk, vv = self._qkv(emb, feat[:m], torch.arange(first, first + m, device=dev) + k, theta)
                keys.append(kk)
                values.append(vv)
            s0 = (q @ keys[0][:, :first + m].transpose(1, 2)) * scale  # [heads, m, first + m]: causal step 0
            future = torch.arange(first + m, device=dev)[None, :] > (torch.arange(m, device=dev) + first)[:, None]
            s0 = s0.masked_fill(future, float("-inf"))
            diag = [(q * keys[j][:, :m]).sum(-1, keepdim=True) * scale for j in range(1, k + 1)]
            att = torch.cat([s0, *diag], -1).softmax(-1)
            out = att[..., :first + m] @ values[0][:, :first + m]
            for j in range(1, k + 1):
                out = out + att[..., first + m + j - 1: first + m + j] * values[j][:, :m]
            h = feat[:m] + out.transpose(0, 1).reshape(m, -1) @ w["midlayer.self_attn.o_proj.weight"].T
            mm = _rms(h, w["midlayer.post_attention_layernorm.weight"])
            mm = (torch.nn.functional.silu(mm @ w["midlayer.mlp.gate_proj.weight"].T)
                  * (mm @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
            h = h + mm
            outs.append((first, _rms(h, w["norm.weight"]) @ w["lm_head.weight"].T))
            feat = h
        return outs


def torch_cat(parts):
    import torch

    return torch.cat(parts, -1)


def init_from_target(head: TrainableHead, target, vocab_ids, layers: list[int]) -> None:
    """Start the head from the target: its decoder layer from the target's last one (q/k/v read the feature
    half of the head's input), ``fc`` picking the highest feature layer, ``norm`` and the draft vocabulary's
    ``lm_head`` rows the target's own. The head then starts in the target's feature space instead of at random
    (EAGLE's heads share the target's LM head for the same reason)."""
    import torch

    w, last, hidden = head.params, target.model.layers[-1], head.hidden
    sd = {k: v.detach().float().cpu() for k, v in last.state_dict().items()}  # the head starts on the CPU
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            p = w[f"midlayer.self_attn.{name}.weight"]
            p.zero_()
            p[:, hidden:] = sd[f"self_attn.{name}.weight"]
        w["midlayer.hidden_norm.weight"].copy_(sd["input_layernorm.weight"])
        for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            w[f"midlayer.{name}.weight"].copy_(sd[f"{name}.weight"])
        w["midlayer.post_attention_layernorm.weight"].copy_(sd["post_attention_layernorm.weight"])
        w["norm.weight"].copy_(target.model.norm.weight.detach().float().cpu())
        w["lm_head.weight"].copy_(target.lm_head.weight.detach().float().cpu()[vocab_ids.cpu()])
        top = max(range(len(layers)), key=lambda i: layers[i])
        w["fc.weight"].zero_()
        w["fc.weight"][:, top * hidden:(top + 1) * hidden] = torch.eye(hidden)
