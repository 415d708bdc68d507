"""`specdec draft train-head` (specdec/distill/head_training.py): a short training on prompts the test writes
lowers the loss, and the checkpoint it writes converts (specdec models export-head) into an ONNX head that
computes what training optimised: the device's first draft position equals the training forward's step 0."""

from __future__ import annotations

import json

import numpy as np
import torch

from specdec.distill.head_training import train_head
from specdec.models.head_export import export_head, load_head

TEXTS = ["The sky is blue because of Rayleigh scattering.", "Write a haiku about the sea.",
         "List three prime numbers and explain why.", "How do I boil an egg?"]


def test_training_lowers_the_loss_and_converts_to_the_same_head(tiny_pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    lines = []
    result = train_head(tiny_pair.target_dir, prompts, tmp_path / "ckpt", num_prompts=4, max_tokens=24,
                        draft_vocab=512, epochs=4, ttt_steps=2, lr=1e-2, progress=lines.append)
    curve = result["curve"]
    assert len(curve) == 4 and len(curve[0]["top1_per_step"]) == 2 and len(lines) == 5  # data + one per epoch
    assert curve[-1]["loss"] < curve[0]["loss"]
    out = export_head(tiny_pair.target_dir, tmp_path / "ckpt", tmp_path / "head")
    loaded = load_head(tiny_pair.target_dir, tmp_path / "ckpt")
    from specdec.distill.head_training import TrainableHead

    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    head = TrainableHead(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                 cfg["intermediate_size"], cfg["draft_vocab_size"])
    head.params = {k: weights[k] for k in head.params}
    ids = [1, 504, 6376, 314, 253, 1789]
    feats = torch.randn(len(ids) - 1, 3 * cfg["hidden_size"], generator=torch.Generator().manual_seed(0))
    embed = loaded.graph.w("embed")
    with torch.inference_mode():
        trained = head.steps(embed[torch.tensor(ids)], feats, cfg["rope_theta"], 1)[0]
        fused = feats @ loaded.fc_weight.float().T
        empty = torch.zeros(1, loaded.meta["num_key_value_heads"], 0, loaded.meta["head_dim"])
        device = loaded.graph(torch.tensor([ids[1:]]), fused[None], torch.arange(len(ids) - 1)[None], empty, empty)[0][0]
    np.testing.assert_allclose(device.numpy(), trained.numpy(), rtol=1e-4, atol=1e-4)
    assert (out / "head.onnx").is_file()
