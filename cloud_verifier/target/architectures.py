"""Which HF causal-LM architectures the target runner can run, and the logits transforms past the LM head.

The ragged forward (:mod:`cloud_verifier.target.attention`) replaces only attention and calls the decoder and the LM head
itself, so it supports a model when (1) its attention layers route through transformers' ``AttentionInterface``
(the model class sets ``_supports_attention_backend``, or it is one of the hybrid families of
:data:`HYBRID_MODEL_TYPES`), (2) every layer is an attention layer with a KV cache (full or sliding-window), or,
for the hybrid families, a conv / SSM / linear-attention layer whose state :mod:`cloud_verifier.kv.recurrent_state`
keeps per session (a model with no attention layer at all, e.g. pure Mamba / Mamba2, is refused), and (3)
whatever the ``ForCausalLM`` wrapper does to the LM head's output is one of :func:`apply_logits_transforms`'
steps. (1) and (2) are checked from the config before the weights load (:func:`check_target_architecture`); (3),
and anything else a model might do differently, by :func:`self_check`, which compares a short ragged forward
(prefill, a half rolled-back block, an accepted block) with the unmodified HF model. Either raises one line naming
what is missing, at ``specdec serve`` (or embedded verifier) start-up.

Tested end to end (tests/e2e/test_architectures.py): Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3,
Granite; hybrids (tests/e2e/test_hybrid_targets.py): LFM2, Qwen3-Next, Qwen3.5, Bamba, Granite 4 hybrid
(granitemoehybrid), Nemotron-H, Falcon-H1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["UnsupportedArchitectureError", "apply_logits_transforms", "check_target_architecture", "self_check"]

KV_LAYER_TYPES = ("full_attention", "sliding_attention")  # config.layer_types the ragged KV cache can hold
# Hybrid families whose conv / SSM / linear-attention layers run on per-session states
# (cloud_verifier.kv.recurrent_state) and whose attention layers call transformers' AttentionInterface (their model
# classes do not set _supports_attention_backend; the self-check compares them with the HF model).
HYBRID_MODEL_TYPES = ("lfm2", "qwen3_next", "qwen3_5_text", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1")
SELF_CHECK_TOKENS = 12  # prefill 6, a block of 4 with 2 rolled back, an accepted block of 2, the last 2


class UnsupportedArchitectureError(ValueError):
    """The target model's architecture cannot run in the ragged verifier (one line naming what is missing)."""


def check_target_architecture(config: Any) -> None:
    """Refuse, before loading weights, a config whose model the ragged runner cannot run.

    Raises:
        UnsupportedArchitectureError: not a causal LM transformers knows, a model class whose attention does
            not go through ``AttentionInterface``, or layers without a KV cache (``config.layer_types``).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    name = _arch_name(config)
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"target architecture {name}: transformers has no causal-LM class for model_type "
            f"{getattr(config, 'model_type', '?')!r}"
        ) from None
    if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES:
        return
    types = getattr(config, "layer_types", None) or []
    if types and not any(t in KV_LAYER_TYPES for t in types):
        raise UnsupportedArchitectureError(
            f"target architecture {name}: no attention layer (layer types {', '.join(sorted(set(types)))}); "
            "pure state-space targets are not supported, hybrids with attention layers are"
        )
    if not getattr(model_class, "_supports_attention_backend", False):
        raise UnsupportedArchitectureError(
            f"target architecture {name}: {model_class.__name__} does not route attention through transformers' "
            "AttentionInterface, which the verifier's ragged attention needs"
        )
    other = sorted({t for t in types if t not in KV_LAYER_TYPES})
    if other:
        raise UnsupportedArchitectureError(
            f"target architecture {name}: layers of type {', '.join(other)} have no KV cache the verifier can "
            f"hold (supported: {', '.join(KV_LAYER_TYPES)})"
        )


def apply_logits_transforms(config: Any, logits: Any) -> Any:
    """What HF's ``ForCausalLM.forward`` does to the LM head's output [..., vocab]: Granite's ``logits_scaling``
    (divide), Falcon-H1's ``lm_head_multiplier`` (multiply), Gemma 2/3's ``final_logit_softcapping`` (c * tanh(logits / c)); anything else: unchanged."""
    import torch

    scaling = getattr(config, "logits_scaling", None)
    if scaling:
        logits = logits / scaling
    multiplier = getattr(config, "lm_head_multiplier", None)
    if multiplier is not None and multiplier != 1.0:
        logits = logits * multiplier
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def self_check(runner: Any) -> float:
    """Compare the ragged forward of ``runner`` (a :class:`cloud_verifier.target.runner.TargetRunner`, which calls this
    while it loads: not imported here, the runner depends on this module) with the HF reference on
    :data:`SELF_CHECK_TOKENS` tokens: a prefill row, a block half rolled back, an accepted block, a last block
    (both ways a hybrid's recurrent state moves past a block: replayed to the accepted prefix, or the state after
    the whole block). Returns the max abs logit difference.

    Raises:
        UnsupportedArchitectureError: the difference exceeds the dtype's tolerance (1e-3 relative in float32,
            5e-2 in 16-bit types, of the reference's largest logit, at least 1): the runner would not reproduce
            the target's output.
    """
    import torch

    from specdec_runtime.cloud_verifier.kv.forward_row import ForwardRow

    ids = (np.arange(SELF_CHECK_TOKENS, dtype=np.int64) * 7919 + 11) % max(1, min(runner.vocab_size, 32000))
    ids = ids.tolist()
    ref = runner.reference_logits(ids)
    kv = runner.allocate(SELF_CHECK_TOKENS)  # freed before any session opens
    try:
        got = [runner.forward([ForwardRow(kv, ids[:6], 0, "all")])[0]]
        # a block rejected after 2 tokens: its last 2 positions are rolled back (KV overwritten, a hybrid's
        # recurrent state replayed to position 8), then a block whose every token is accepted (the state after
        # the block taken as is), then the rest
        got.append(runner.forward([ForwardRow(kv, ids[6:8] + [0, 1], 6, "all")])[0][:2])
        got.append(runner.forward([ForwardRow(kv, ids[8:10], 8, "all")])[0])
        got.append(runner.forward([ForwardRow(kv, ids[10:], 10, "all")])[0])
    finally:
        runner.free(kv)
    diff = float(np.abs(np.concatenate(got) - ref).max())
    rel = 1e-3 if runner.dtype == torch.float32 else 5e-2
    tolerance = rel * max(1.0, float(np.abs(ref).max()))
    if not diff <= tolerance:
        raise UnsupportedArchitectureError(
            f"target architecture {_arch_name(runner.config)}: the verifier's forward differs from the HF "
            f"reference by {diff:.3g} (tolerance {tolerance:.3g}); something this model does is not supported"
        )
    return diff


def _arch_name(config: Any) -> str:
    archs = getattr(config, "architectures", None) or [type(config).__name__]
    return str(archs[0])
