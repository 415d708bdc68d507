"""Tiny random draft-head checkpoints in the layouts their authors publish (SafeAILab/EAGLE), written by the tests
themselves for a tiny target: EAGLE-3 (config.json with draft_vocab_size; model.safetensors with fc, midlayer.*,
norm, lm_head, d2t, t2d) and EAGLE-1 (Llama config; fc with bias, layers.0.*)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _layer(prefix: str, hidden: int, q_in: int, heads: int, kv_heads: int, inter: int, g) -> dict:
    d = hidden // heads

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    out = {f"{prefix}self_attn.q_proj.weight": w(heads * d, q_in), f"{prefix}self_attn.k_proj.weight": w(kv_heads * d, q_in),
           f"{prefix}self_attn.v_proj.weight": w(kv_heads * d, q_in), f"{prefix}self_attn.o_proj.weight": w(hidden, heads * d),
           f"{prefix}mlp.gate_proj.weight": w(inter, hidden), f"{prefix}mlp.up_proj.weight": w(inter, hidden),
           f"{prefix}mlp.down_proj.weight": w(hidden, inter),
           f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g)}
    return out


def write_eagle3(out: Path, target_dir: Path, draft_token_ids: list[int], seed: int = 0, hidden: int | None = None,
                 embedding: torch.Tensor | None = None, heads: int = 4, kv_heads: int = 2,
                 intermediate: int | None = None) -> Path:
    """An EAGLE-3 checkpoint for the HF target in ``target_dir`` whose draft vocabulary is ``draft_token_ids``
    (sorted target ids). ``hidden`` (default: the target's) and ``embedding`` (stored as embed_tokens.weight
    when given) let a test make a head for another target; ``heads``/``kv_heads``/``intermediate`` its shape."""
    from safetensors.torch import save_file

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    h = hidden or tcfg["hidden_size"]
    inter, vocab = intermediate or 2 * h, tcfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    weights = _layer("midlayer.", h, 2 * h, heads, kv_heads, inter, g)
    weights["midlayer.input_layernorm.weight"] = torch.ones(h)
    weights["midlayer.hidden_norm.weight"] = torch.ones(h)
    weights["fc.weight"] = torch.randn(h, 3 * h, generator=g) * 0.1
    weights["norm.weight"] = torch.ones(h)
    ids = torch.tensor(sorted(draft_token_ids), dtype=torch.int64)
    weights["lm_head.weight"] = torch.randn(len(ids), h, generator=g) * 0.5
    weights["d2t"] = ids - torch.arange(len(ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    weights["t2d"] = t2d
    if embedding is not None:
        weights["embed_tokens.weight"] = embedding
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "intermediate_size": inter, "vocab_size": vocab,
              "draft_vocab_size": len(ids), "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 512, "num_hidden_layers": 1}
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_eagle1(out: Path, target_dir: Path, seed: int = 0) -> Path:
    """An EAGLE-1 checkpoint (one layer, fc over [embedding, feature] with bias) for the target in ``target_dir``."""
    from safetensors.torch import save_file

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    h = tcfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    weights = _layer("layers.0.", h, h, 4, 2, 2 * h, g)
    weights["fc.weight"] = torch.randn(h, 2 * h, generator=g) * 0.2
    weights["fc.bias"] = torch.zeros(h)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    config = dict(tcfg, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    (out / "config.json").write_text(json.dumps(config))
    return out
