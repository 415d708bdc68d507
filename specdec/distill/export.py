"""The end of a distillation run: the artefact (draft-specific tensors) and the ONNX draft rebuilt from it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specdec.distill.data import DATA_DIR, frequent_token_ids, load_data
from specdec.distill.metrics import evaluate

CKPT_FILE = "ckpt.pt"


def export_checkpoint(
    target_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    artefact_dir: str | os.PathLike | None = None,
    onnx_dir: str | os.PathLike | None = None,
    quantize_int8: bool = False,
    target: Any = None,
    heldout: list[dict] | None = None,
    refresh_head: bool = True,
    head_prompt_weight: float = 0.5,
) -> dict[str, Any]:
    """Artefact + ONNX draft from the training checkpoint in ``out_dir`` (also usable while training runs).

    Writes the artefact (draft-specific tensors, fp16, head ids, config) to ``artefact_dir`` (default
    ``out_dir/artefact``), rebuilds the draft from the target + artefact exactly as
    :func:`specdec.models.install_distilled_draft` does, exports it to ``onnx_dir`` (default ``out_dir/onnx``;
    ONNX vs PyTorch checked) and evaluates the rebuilt draft on the held-out answers.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models import (
        build_distilled_draft,
        export_distilled_onnx,
        load_distilled_draft,
        save_distilled_artefact,
    )

    out_dir = Path(out_dir)
    ckpt = torch.load(out_dir / CKPT_FILE, weights_only=False)
    if target is None:
        target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train, held_all = load_data(out_dir / DATA_DIR)
    if heldout is None:
        heldout = held_all
    head_ids = ckpt["head_ids"]
    if refresh_head and train:
        # The head rows are frozen target rows: the head vocabulary can be re-chosen from all the data generated
        # by now (training only used it to normalise q), which estimates token frequencies better.
        always = tuple(t for t in {pad_id, *tok.all_special_ids} if t is not None and t < target.config.vocab_size)
        head_ids = frequent_token_ids(train, target.config.vocab_size, len(head_ids), always=always,
                                      prompt_weight=head_prompt_weight)
    draft = build_distilled_draft(target, ckpt["num_layers"], head_ids, layer_state=ckpt["model"])
    st = ckpt["state"]
    last = st["evals"][-1] if st["evals"] else {}
    art = Path(artefact_dir) if artefact_dir is not None else out_dir / "artefact"
    extra = {
        "init_layer_ids": ckpt["init_layer_ids"],
        "head_refreshed_from_answers": sum(len(r["answer_ids"]) for r in train) if refresh_head else None,
        "training": {"steps": st["step"], "train_s": round(st["train_s"], 1), "seen_tokens": st["seen_tokens"],
                     "epochs": st["epoch"]},
        "heldout_at_checkpoint": {k: last.get(k) for k in ("agreement", "coverage", "sim_acceptance", "sim_tau")},
    }
    save_distilled_artefact(draft, target, art, extra=extra)
    installed = load_distilled_draft(target, art)  # what users get (fp16-rounded weights)
    installed.config._attn_implementation = "eager"
    lut = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    lut[installed.lm_head.token_ids] = torch.arange(len(installed.lm_head.token_ids))
    res: dict[str, Any] = {
        "artefact_dir": str(art),
        "artefact_bytes": sum(f.stat().st_size for f in art.iterdir() if f.is_file()),
        "heldout_installed": evaluate(installed, heldout, pad_id, lut) if heldout else {},
    }
    cfg_path = art / "draft_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["heldout_installed"] = res["heldout_installed"]
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    onnx_out = Path(onnx_dir) if onnx_dir is not None else out_dir / "onnx"
    export_distilled_onnx(installed, tok, onnx_out, quantize_int8=quantize_int8, check=True,
                          extra_report={"artefact": str(art), "source": str(target_dir)})
    res["onnx_dir"] = str(onnx_out)
    rep = json.loads((onnx_out / "specdec_export.json").read_text())
    res["onnx_max_abs_diff"] = rep.get("fp32_check", {}).get("max_abs_diff")
    res["onnx_bytes"] = rep.get("model_bytes")
    return res
