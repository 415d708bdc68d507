"""``specdec draft train-head``: train an EAGLE-3 draft head for a target on its own features and next-token
distributions, with EAGLE-3's training-time test (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test"), and write it in the layout EAGLE-3's authors publish, so that
``specdec models export-head`` (:mod:`specdec.models.head_export`) converts it like any published head.

Data: the prompt texts of the training prompts file (never the benchmark prompts), chat template applied,
truncated to ``max_tokens``. Per sequence the target runs once (no grad): its hidden states at EAGLE-3's three
layers (concatenated: the head's fc fuses them) and its next-token distribution at every position, restricted to
the draft vocabulary (the ``draft_vocab`` most frequent target tokens of the data; ``d2t`` maps them back).

Training-time test: step 0 feeds entry t = (x_{t+1}, fc(f_t)) and learns p_target(x_{t+2} | x_≤t+1); step k feeds
(x_{t+1+k}, h^{k-1}_t), the head's own output of step k-1, attending to the step-0 entries 0..t and to its own
entries of steps 1..k at t, as drafting does at its k-th token; the loss of step k is the cross-entropy against
p_target(· | x_≤t+1+k) on the draft vocabulary, weighted 0.8^k as in EAGLE-3.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

__all__ = ["TrainableHead", "train_head"]


def _rms(x, w, eps=1e-6):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w


def _rope(x, pos, theta):
    import torch

    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
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

    def steps(self, emb_seq, target_features, theta: float, num_steps: int):
        """The head's logits [n - k, draft_vocab] of each TTT step k for a sequence of L tokens: ``emb_seq`` the
        target's embeddings [L, H], ``target_features`` [L - 1, 3H] (positions 0 .. L-2), n = L - 1 entries."""
        import torch

        w, n = self.params, target_features.shape[0]
        feat, keys, values, outs = target_features @ w["fc.weight"].T, [], [], []
        for k in range(num_steps):
            m = n - k  # entries t = 0..m-1 have token x_{t+1+k}
            emb = emb_seq[1 + k: 1 + k + m]
            q, kk, vv = self._qkv(emb, feat[:m], torch.arange(m) + k, theta)
            keys.append(kk)
            values.append(vv)
            scale = 1.0 / math.sqrt(self.d)
            s0 = (q @ keys[0][:, :m].transpose(1, 2)) * scale  # [H, m, m] step-0 entries, causal
            s0 = s0.masked_fill(torch.triu(torch.ones(m, m, dtype=torch.bool), 1), float("-inf"))
            diag = [(q * keys[j][:, :m]).sum(-1, keepdim=True) * scale for j in range(1, k + 1)]
            att = torch.cat([s0, *diag], -1).softmax(-1)
            out = att[..., :m] @ values[0][:, :m]
            for j in range(1, k + 1):
                out = out + att[..., m + j - 1: m + j] * values[j][:, :m]
            attn = out.transpose(0, 1).reshape(m, -1) @ w["midlayer.self_attn.o_proj.weight"].T
            h = feat[:m] + attn
            mm = _rms(h, w["midlayer.post_attention_layernorm.weight"])
            mm = (torch.nn.functional.silu(mm @ w["midlayer.mlp.gate_proj.weight"].T)
                  * (mm @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
            h = h + mm
            outs.append(_rms(h, w["norm.weight"]) @ w["lm_head.weight"].T)
            feat = h
        return outs


def torch_cat(parts):
    import torch

    return torch.cat(parts, -1)


def _load_texts(path: Path, limit: int) -> list[str]:
    texts = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                texts.append(str(json.loads(line)["prompt"]))
            if len(texts) >= limit:
                break
    return texts


def _target_data(target, tok, texts: list[str], max_tokens: int, layers: list[int]):
    """Per text: (token ids [L], concatenated features [L - 1, 3H], target probs [L, V]) (no grad)."""
    import torch

    out = []
    for text in texts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
        ids = list(tok(chat, add_special_tokens=False).input_ids)[:max_tokens]
        if len(ids) < 4:
            continue
        with torch.inference_mode():  # index i: the input of layer i; num_hidden_layers: the final normed state
            o = target.model(torch.tensor([ids]), output_hidden_states=True)
            states = list(o.hidden_states[: target.config.num_hidden_layers]) + [o.last_hidden_state]
            probs = target.lm_head(o.last_hidden_state)[0].float().softmax(-1)
        feats = torch.cat([states[i][0] for i in layers], -1)[:-1]
        out.append((ids, feats.clone(), probs.clone()))
    return out


def train_head(target_dir, prompts_path, out_dir, *, num_prompts: int = 200, max_tokens: int = 96,
               draft_vocab: int = 8192, epochs: int = 2, ttt_steps: int = 3, lr: float = 3e-3,
               progress: Callable[[str], None] = print) -> dict:
    """Train an EAGLE-3 head for the HF target in ``target_dir`` on the first ``num_prompts`` prompts of
    ``prompts_path`` (jsonl with a ``prompt`` field); write the checkpoint (config.json, model.safetensors) into
    ``out_dir``; return the curve: per epoch the mean loss and the top-1 agreement with the target's argmax at
    each TTT step (a proxy of greedy acceptance at draft position k + 1), and the seconds it took."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    cfg = target.config
    n = cfg.num_hidden_layers
    layers = [min(2, n), n // 2, max(n - 3, 0)]  # the inputs of those layers: specdec.models.head_export's
    data = _target_data(target, tok, _load_texts(Path(prompts_path), num_prompts), max_tokens, layers)
    counts = torch.zeros(target.get_input_embeddings().weight.shape[0])
    for ids, _, _ in data:
        counts += torch.bincount(torch.tensor(ids), minlength=len(counts))[: len(counts)]
    probs_mass = sum(p.sum(0) for _, _, p in data)
    vocab_ids = torch.sort(torch.topk(counts + probs_mass, draft_vocab).indices).values
    progress(f"data: {len(data)} sequences, {sum(len(d[0]) for d in data)} tokens, {time.monotonic() - t0:.0f} s")
    theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 1e4)))
    head = TrainableHead(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                 draft_vocab)
    embed = target.get_input_embeddings().weight.detach()
    opt = torch.optim.AdamW(head.params.values(), lr=lr, weight_decay=0.0)
    curve = []
    for epoch in range(epochs):
        losses, agree, seen = [], [0] * ttt_steps, [0] * ttt_steps
        for i in torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch)).tolist():
            ids, feats, probs = data[i]
            outs = head.steps(embed[torch.tensor(ids)], feats, theta, ttt_steps)
            loss = 0.0
            for k, logits in enumerate(outs):
                p = probs[1 + k: 1 + k + logits.shape[0]][:, vocab_ids]
                p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
                loss = loss + 0.8 ** k * -(p * logits.log_softmax(-1)).sum(-1).mean()
                agree[k] += int((vocab_ids[logits.argmax(-1)] == probs[1 + k: 1 + k + logits.shape[0]].argmax(-1)).sum())
                seen[k] += logits.shape[0]
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        point = {"epoch": epoch + 1, "loss": sum(losses) / len(losses),
                 "top1_per_step": [a / max(s, 1) for a, s in zip(agree, seen)], "s": time.monotonic() - t0}
        curve.append(point)
        progress(f"epoch {epoch + 1}/{epochs}: loss {point['loss']:.3f}, top-1 agreement per draft position "
                 + ", ".join(f"{x:.3f}" for x in point["top1_per_step"]) + f" ({point['s']:.0f} s)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous() for k, v in head.params.items()}
    weights["d2t"] = vocab_ids - torch.arange(draft_vocab)
    t2d = torch.zeros(len(counts), dtype=torch.bool)
    t2d[vocab_ids] = True
    weights["t2d"] = t2d
    save_file(weights, str(out_dir / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": cfg.hidden_size,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "intermediate_size": cfg.intermediate_size, "vocab_size": len(counts), "draft_vocab_size": draft_vocab,
              "rms_norm_eps": 1e-6, "rope_theta": theta, "max_position_embeddings": cfg.max_position_embeddings,
              "num_hidden_layers": 1}
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    (out_dir / "training.json").write_text(json.dumps({"curve": curve, "prompts": str(prompts_path)}, indent=1))
    return {"curve": curve, "seconds": time.monotonic() - t0}
