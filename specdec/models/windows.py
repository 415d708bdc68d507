"""Sliding-window attention of an HF config, layer by layer, as the ONNX draft exporters need it.

transformers describes windows two ways: ``config.layer_types`` ("sliding_attention" / "full_attention" per layer,
Gemma 2/3, Qwen2/3) with ``config.sliding_window``, or ``sliding_window`` alone, applied to every layer (Mistral,
Phi-3). A query at position i sees keys i - W < j <= i (HF's convention; GroupQueryAttention's
``local_window_size`` = W means the same). Both exporters must reproduce it: the torch.onnx wrapper builds one
mask per layer type, and ONNX Runtime GenAI's builder, which reads only ``layer_types``, is given a config that
spells it out (:func:`genai_input_dir`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["layer_windows", "genai_input_dir"]


def layer_windows(config: Any) -> list[int | None]:
    """The sliding window of each decoder layer, tokens (None: full attention); length ``num_hidden_layers``."""
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types:
        return [int(window) if window and t == "sliding_attention" else None for t in list(types)[:num_layers]]
    return [int(window) if window else None] * num_layers


def genai_input_dir(src: Path, config: Any, scratch: Path) -> Path:
    """``src`` itself, or, when its config has a uniform window but no ``layer_types`` (Mistral, Phi-3; the GenAI
    builder would build full attention), a directory under ``scratch`` with links to ``src``'s files and a
    config.json that names every layer "sliding_attention"."""
    if getattr(config, "layer_types", None) or not any(layer_windows(config)):
        return src
    out = Path(tempfile.mkdtemp(prefix="genai-input-", dir=scratch))
    for f in src.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    data = json.loads((src / "config.json").read_text())
    data["layer_types"] = ["sliding_attention"] * int(config.num_hidden_layers)
    (out / "config.json").write_text(json.dumps(data, indent=2))
    return out
