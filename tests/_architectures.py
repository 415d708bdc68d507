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
# Architectures the verifier refuses, with the words its one-line error must contain.
REFUSED = {
    "lfm2": "layers of type conv have no KV cache",
    "mamba": "does not route attention through transformers' AttentionInterface",
}


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
        return tf.Lfm2Config(**_common(layer_types=["conv", "full_attention"]))
    if arch == "mamba":
        return tf.MambaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, state_size=8, num_hidden_layers=2,
                              bos_token_id=1, eos_token_id=2, pad_token_id=2)
    raise ValueError(f"unknown architecture {arch!r}")


def make_tiny_model(arch: str, out_dir: Path, tokenizer: Any, seed: int = 0) -> Path:
    """Save the tiny random ``arch`` model (float32, seeded) and ``tokenizer`` into ``out_dir``; returns it."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
