"""Tiny random-weight models of every causal-LM architecture the verifier and the draft exporter claim.

Each model is made from its transformers config (2 layers, hidden 64, the SmolLM2 tokenizer's 49152 ids), never
downloaded. Sliding windows are shortened to ``WINDOW`` tokens so that the tests' sequences cross them: a kernel
that ignored the window would be caught. ``initializer_range`` 0.2 makes the logits peaked enough that argmax
ties between PyTorch and ONNX Runtime rounding are practically impossible.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB_SIZE = 49152  # the SmolLM2 tokenizer's ids
WINDOW = 16  # sliding window of the windowed architectures, tokens
MAX_POSITIONS = 512

# What each architecture exercises (docs/models.md's table repeats it).
NOTES = {
    "llama": "GQA 4:2, tied head",
    "mistral": f"sliding window {WINDOW} on every layer, untied head",
    "qwen2": "q/k/v biases, GQA",
    "qwen3": "qk-norm, explicit head_dim",
    "phi3": f"fused qkv / gate_up, partial rotary 0.5, sliding window {WINDOW}",
    "gemma2": f"attention + final logit soft-capping, query_pre_attn_scalar, windows {WINDOW}/full alternating",
    "gemma3": f"qk-norm, local/global rope, windows {WINDOW}/full",
    "granite": "embedding / residual / attention multipliers, logits_scaling",
}
ARCHITECTURES = tuple(NOTES)
# Hybrid targets: recurrent layers (conv, SSM, linear attention) beside attention (cloud_verifier/kv/recurrent_state.py)
HYBRID_NOTES = {
    "lfm2": "short conv (kernel 3), then attention",
    "qwen3_next": "gated delta rule + conv, then gated attention; MoE MLPs",
    "qwen3_5": "gated delta rule + conv, then gated attention",
    "bamba": "Mamba2 mixer, then attention",
    "granitemoehybrid": "Mamba2 mixer, then attention; MoE, Granite multipliers",
    "nemotron_h": "Mamba2 mixer, attention, MLP as separate layers",
    "falcon_h1": "attention and a Mamba2 mixer in parallel in every layer, lm_head_multiplier",
}
HYBRIDS = tuple(HYBRID_NOTES)
# Architectures the verifier refuses, with the words its one-line error must contain.
REFUSED = {
    "mamba": "no attention layer",
    "mamba2": "no attention layer",
}
# Embedding scale of each tiny hybrid target, so that a draft sharing its embeddings (make_sibling_draft) agrees
# with it on a fraction of tokens (greedy, teacher-forced: 0.3-0.6 measured): the embedding dominates the residual
# stream, the recurrent and attention layers still flip about half the argmaxes.
HYBRID_EMBEDDING_SCALE = {"lfm2": 200.0, "qwen3_next": 50.0}


def _common(**extra: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    base.update(extra)
    return base


def tiny_config(arch: str) -> Any:
    """The transformers config of the tiny ``arch`` model (one of :data:`ARCHITECTURES`)."""
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**_common(tie_word_embeddings=True))
    if arch == "mistral":
        return tf.MistralConfig(**_common(sliding_window=WINDOW, tie_word_embeddings=False))
    if arch == "qwen2":
        return tf.Qwen2Config(**_common(tie_word_embeddings=True))
    if arch == "qwen3":
        return tf.Qwen3Config(**_common(head_dim=16, tie_word_embeddings=True))
    if arch == "phi3":
        # head_dim 32: GenAI's GroupQueryAttention needs a rotary half-width that is a multiple of 8
        return tf.Phi3Config(**_common(hidden_size=128, partial_rotary_factor=0.5, sliding_window=WINDOW,
                                       original_max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False))
    if arch == "gemma2":
        return tf.Gemma2Config(**_common(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                         attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                         layer_types=["sliding_attention", "full_attention"]))
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**_common(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                             layer_types=["sliding_attention", "full_attention"]))
    if arch == "granite":
        return tf.GraniteConfig(**_common(embedding_multiplier=2.0, residual_multiplier=0.5,
                                          attention_multiplier=0.2, logits_scaling=4.0, tie_word_embeddings=True))
    if arch == "lfm2":  # a convolution layer before an attention layer
        return tf.Lfm2Config(**_common(layer_types=["conv", "full_attention"], tie_word_embeddings=False))
    if arch in ("qwen3_next", "qwen3_5"):  # gated delta rule, then gated attention (Qwen3-Next: MoE MLPs)
        linear = {"head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
                  "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                  "layer_types": ["linear_attention", "full_attention"]}
        if arch == "qwen3_5":
            return tf.Qwen3_5TextConfig(**_common(**linear))
        return tf.Qwen3NextConfig(**_common(**linear, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=32))
    # chunk 16: prompts span several chunks of the scan
    mamba = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4,
             "mamba_chunk_size": 16}
    if arch == "bamba":  # Mamba2 mixer, then attention
        return tf.BambaConfig(**_common(**mamba, attn_layer_indices=[1]))
    if arch == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(**_common(**mamba, layer_types=["linear_attention", "full_attention"],
                                                   num_local_experts=4, shared_intermediate_size=64,
                                                   embedding_multiplier=2.0, logits_scaling=4.0))
    if arch == "falcon_h1":  # attention and a Mamba2 mixer side by side in every layer, mup multipliers
        return tf.FalconH1Config(**_common(**mamba, mamba_d_ssm=128, head_dim=16, lm_head_multiplier=0.5))
    if arch == "nemotron_h":
        return tf.NemotronHConfig(**_common(ssm_state_size=8, mamba_num_heads=8, mamba_head_dim=16, n_groups=1,
                                            conv_kernel=4, chunk_size=16, head_dim=16, n_routed_experts=4,
                                            moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                                            layers_block_type=["linear_attention", "full_attention", "mlp"]))
    if arch == "mamba2":
        return tf.Mamba2Config(vocab_size=VOCAB_SIZE, hidden_size=64, num_heads=8, head_dim=16, state_size=8,
                               n_groups=1, chunk_size=16, num_hidden_layers=2, bos_token_id=1, eos_token_id=2,
                               pad_token_id=2)
    if arch == "mamba":
        return tf.MambaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, state_size=8, num_hidden_layers=2,
                              bos_token_id=1, eos_token_id=2, pad_token_id=2)
    raise ValueError(f"unknown architecture {arch!r}")


def make_tiny_model(arch: str, out_dir: Path, tokenizer: Any, seed: int = 0) -> Path:
    """Save the tiny random ``arch`` model (float32, seeded) and ``tokenizer`` into ``out_dir``; returns it.
    Hybrids get their input embeddings scaled by :data:`HYBRID_EMBEDDING_SCALE` (100 by default)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
    if arch in HYBRIDS:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(HYBRID_EMBEDDING_SCALE.get(arch, 100.0))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_sibling_draft(target_dir: Path, out_dir: Path, tokenizer: Any, seed: int = 1) -> Path:
    """Save a tiny random Llama (hidden 64, untied head) that shares the input embeddings and LM head of the HF
    model in ``target_dir``, its own layers scaled by 0.1: a draft that agrees with the target on a fraction of
    tokens. Returns ``out_dir``."""
    import torch
    import transformers as tf
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    draft = AutoModelForCausalLM.from_config(tf.LlamaConfig(**_common(tie_word_embeddings=False)),
                                             dtype=torch.float32).eval()
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight)
        for layer in draft.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    draft.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
