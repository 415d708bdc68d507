"""Independent reference implementations the tests compare against (plain HF transformers)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Target-only greedy decoding with plain HF generate() (independent reference implementation)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()
