"""``specdec models export-head TARGET HEAD OUT``: an EAGLE-3 or EAGLE-1 draft head checkpoint, in the layout its
authors publish, with the target it was trained for → the device's ONNX head (:mod:`specdec.models.head_graph`;
run by :class:`edge_client.drafting.head.OnnxHead`).

Layouts read (Li et al., github.com/SafeAILab/EAGLE):

- EAGLE-3: ``config.json`` with ``draft_vocab_size`` (and ``hidden_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``vocab_size``, ``rms_norm_eps``, ``rope_theta``; ``target_hidden_size`` optional);
  weights (``*.safetensors`` or ``pytorch_model.bin``) ``fc.weight`` [H, 3·H_target], ``midlayer.*``,
  ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` [draft_vocab] (target id = draft id + d2t),
  ``t2d`` [vocab] (bool); ``embed_tokens.weight`` optional (else the target's).
- EAGLE-1: the target's Llama ``config.json``; weights ``fc.weight`` [H, 2H], ``fc.bias``, ``layers.0.*``;
  ``embed_tokens.weight`` optional; logits through the target's ``lm_head``.

The output directory: ``head.onnx``, ``fuse.onnx`` (EAGLE-3's fc), ``d2t.npy`` (target id of each draft id,
int64; EAGLE-3), ``head.json`` (what the device and the verifier need: kind, feature layers, widths, the target's
identity), the target's tokenizer files.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["HeadMismatchError", "LoadedHead", "load_head", "load_target", "export_head", "embedding_sha256",
           "HEAD_FORMAT"]

HEAD_FORMAT = "specdec-head/1"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "chat_template.jinja", "chat_template.json",
                    "vocab.json", "merges.txt")


class HeadMismatchError(ValueError):
    """The head was not trained for this target (hidden size, vocabulary or embedding differ), or its
    checkpoint is not in a layout this reads; the message is one line."""


def embedding_sha256(weight) -> str:
    """sha256 of an embedding matrix's float32 little-endian bytes (torch tensor or numpy array [V, H])."""
    array = weight.detach().float().cpu().numpy() if hasattr(weight, "detach") else np.asarray(weight, np.float32)
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<f4").tobytes()).hexdigest()


def _load_weights(head_dir: Path) -> dict:
    import torch

    files = sorted(head_dir.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        weights: dict = {}
        for f in files:
            weights.update(load_file(str(f)))
        return weights
    binary = head_dir / "pytorch_model.bin"
    if binary.is_file():
        return torch.load(str(binary), map_location="cpu", weights_only=True)
    raise HeadMismatchError(f"{head_dir}: no *.safetensors or pytorch_model.bin")


def _is_head_checkpoint(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a draft head checkpoint (EAGLE-3's config, or an ``fc`` in its safetensors)
    rather than a causal LM: read from config.json and the safetensors' names, no weights loaded."""
    from safetensors import safe_open

    config_path = model_dir / "config.json"
    cfg = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if "draft_vocab_size" in cfg or any("eagle" in str(a).lower() for a in cfg.get("architectures") or ()):
        return True
    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                if "fc.weight" in st.keys():
                    return True
        except Exception:  # a damaged file: transformers' load says what is wrong with it
            return False
    return False


def load_target(target_dir: str | Path):
    """The HF causal LM in ``target_dir`` (float32, eval) a head is converted for.

    Raises:
        ModelNotFoundError: one line: ``target_dir`` holds a draft head checkpoint (the arguments swapped), or
            no causal LM transformers can load (no config.json, an unknown model type, no weights).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_runtime.common.paths import ModelNotFoundError

    target_dir = Path(target_dir)
    if not (target_dir / "config.json").is_file():
        raise ModelNotFoundError(f"{target_dir}: not a model directory (no config.json)")
    if _is_head_checkpoint(target_dir):
        raise ModelNotFoundError(f"{target_dir} is a draft head checkpoint, not the target model: give the "
                                 "target's HF directory first, then the head's (TARGET HEAD OUT)")
    try:
        return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    except (OSError, ValueError, KeyError, TypeError) as e:  # transformers' errors for a directory it cannot load
        reason = next(iter(str(e).strip().splitlines()), "") or type(e).__name__
        raise ModelNotFoundError(f"{target_dir}: not a causal LM transformers can load ({reason})") from e


def _check_target(kind: str, cfg: dict, weights: dict, target) -> None:
    """Raise HeadMismatchError (one line) unless the head's widths, vocabulary and embedding are the target's."""
    tcfg, embed = target.config, target.get_input_embeddings().weight
    target_hidden, target_vocab = int(tcfg.hidden_size), int(embed.shape[0])
    head_target_hidden = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    fc_in = int(weights["fc.weight"].shape[1])
    want_fc = (3 if kind == "eagle3" else 2) * target_hidden
    problems = []
    if head_target_hidden != target_hidden or fc_in != want_fc:
        problems.append(f"hidden size {head_target_hidden} (fc in {fc_in}) vs the target's {target_hidden}")
    if int(cfg.get("vocab_size", target_vocab)) != target_vocab:
        problems.append(f"vocabulary {cfg.get('vocab_size')} vs the target's {target_vocab}")
    own = weights.get("embed_tokens.weight")
    if not problems and own is not None and embedding_sha256(own) != embedding_sha256(embed):
        problems.append("its embedding's sha256 differs from the target's")
    if problems:
        raise HeadMismatchError(f"the head was not trained for this target: {'; '.join(problems)}")


def _graph_weights(kind: str, weights: dict, target) -> tuple[dict, object]:
    """(HeadGraph weights, d2t target ids or None) of a checkpoint."""
    prefix = "midlayer." if kind == "eagle3" else "layers.0."
    out = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    out["embed"] = weights.get("embed_tokens.weight", target.get_input_embeddings().weight)
    if kind == "eagle3":
        out["norm.weight"] = weights["norm.weight"]
        out["lm_head"] = weights["lm_head.weight"]
        d2t = weights["d2t"].long().cpu().numpy()
        return out, np.arange(len(d2t), dtype=np.int64) + d2t
    out["fc.weight"], out["fc.bias"] = weights["fc.weight"], weights["fc.bias"]
    out["lm_head"] = target.get_output_embeddings().weight
    return out, None


@dataclass
class LoadedHead:
    """A checkpoint read and checked against its target: the torch graph, the layers it reads, its d2t
    (target ids of the draft vocabulary, or None), EAGLE-3's fc weight (or None) and head.json's content."""

    graph: object  # specdec.models.head_graph.HeadGraph
    fc_weight: object
    d2t: np.ndarray | None
    meta: dict


def load_head(target_dir: str | Path, head_dir: str | Path) -> LoadedHead:
    """Read the checkpoint in ``head_dir`` (EAGLE-3 or EAGLE-1, see the module docstring) for the HF target in
    ``target_dir`` and check that it was trained for it.

    Raises:
        HeadMismatchError: a head trained for another target, or a layout this does not read (one line).
        ModelNotFoundError: ``target_dir`` is no causal LM (:func:`load_target`; one line).
    """
    from specdec.models.head_graph import HeadGraph

    head_dir = Path(head_dir)
    config_path = head_dir / "config.json"
    if not config_path.is_file():
        raise HeadMismatchError(f"{head_dir}: no config.json")
    cfg = json.loads(config_path.read_text())
    weights = _load_weights(head_dir)
    kind = "eagle3" if "draft_vocab_size" in cfg or "midlayer.self_attn.q_proj.weight" in weights else "eagle1"
    if "fc.weight" not in weights or ("layers.0.self_attn.q_proj.weight" not in weights and kind == "eagle1"):
        raise HeadMismatchError(f"{head_dir}: not an EAGLE-3 or EAGLE-1 checkpoint (no fc / midlayer / layers.0)")
    target = load_target(target_dir)
    _check_target(kind, cfg, weights, target)
    graph_weights, d2t = _graph_weights(kind, weights, target)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    graph = HeadGraph(kind, graph_weights, heads, kv_heads, head_dim, float(cfg.get("rms_norm_eps", 1e-6)),
                      float(cfg.get("rope_theta", 10000.0))).eval()
    n = int(target.config.num_hidden_layers)
    layers = [min(2, n), n // 2, max(n - 3, 0)] if kind == "eagle3" else [-1]
    embed = target.get_input_embeddings().weight
    meta = {"format": HEAD_FORMAT, "kind": kind, "feature_layers": layers,
            "target_feature_width": len(layers) * int(target.config.hidden_size), "hidden_size": hidden,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "draft_vocab_size": int(graph_weights["lm_head"].shape[0]),
            "max_position_embeddings": int(cfg.get("max_position_embeddings") or 2048),
            "target": {"hidden_size": int(target.config.hidden_size), "num_hidden_layers": n,
                       "vocab_size": int(embed.shape[0]), "embedding_sha256": embedding_sha256(embed)}}
    return LoadedHead(graph, weights["fc.weight"] if kind == "eagle3" else None, d2t, meta)


def export_head(target_dir: str | Path, head_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert the checkpoint in ``head_dir`` for the HF target in ``target_dir`` (:func:`load_head`) into
    ``out_dir``; returns ``out_dir``.

    Raises:
        HeadMismatchError: a head trained for another target, or a layout this does not read (one line).
        ModelNotFoundError: ``target_dir`` is no causal LM (:func:`load_target`; one line).
    """
    from specdec.models.head_graph import export_fuse_onnx, export_head_onnx

    head = load_head(target_dir, head_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    export_head_onnx(head.graph, head.meta["hidden_size"], out_dir / "head.onnx")
    if head.fc_weight is not None:
        export_fuse_onnx(head.fc_weight, out_dir / "fuse.onnx")
    if head.d2t is not None:
        np.save(out_dir / "d2t.npy", head.d2t)
    (out_dir / "head.json").write_text(json.dumps(head.meta, indent=1) + "\n")
    for name in _TOKENIZER_FILES:
        if (Path(target_dir) / name).is_file():
            shutil.copy(Path(target_dir) / name, out_dir / name)
    return out_dir
