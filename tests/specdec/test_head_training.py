"""`specdec draft train-head` (specdec/distill/head_training.py, head_data.py): a short training on the target's
own answers to prompts the test writes lowers the loss, and the checkpoint it writes converts (specdec models
export-head) into a head that computes what training optimised: every training-time-test step k equals the
device's graph drafting its (k+1)-th token with its KV cache and its own features, at the same positions."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdec.distill.head_training import TrainableHead, train_head
from specdec.models.head_export import export_head, load_head

TEXTS = ["The sky is blue because of Rayleigh scattering.", "Write a haiku about the sea.",
         "List three prime numbers and explain why.", "How do I boil an egg?"]


@pytest.fixture(scope="module")
def trained(tiny_pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_head")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    lines = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_CACHE_DIR", str(tmp / "cache"))  # the answers' cache
        result = train_head(tiny_pair.target_dir, prompts, tmp / "ckpt", num_prompts=4, max_prompt_tokens=64,
                            max_new_tokens=16, draft_vocab=512, epochs=4, ttt_steps=3, lr=1e-2,
                            heldout_fraction=0.25, progress=lines.append)  # 4 sequences: one held out
    return tmp, result, lines


def test_training_on_the_targets_answers_lowers_the_loss(trained):
    tmp, result, lines = trained
    curve = result["curve"]
    assert len(curve) == 4 and len(curve[0]["top1_per_step"]) == 3
    assert any(line.startswith("answers: 4/4") for line in lines)
    assert curve[-1]["loss"] < curve[0]["loss"]
    assert (tmp / "cache" / "head-data").is_dir()


def test_every_ttt_step_is_what_the_device_drafts(trained, tiny_pair):
    """Step k of the training forward, row t (entry t + k after entries 0..t of target features) must equal the
    converted graph fed entries 0..t with the target's features, then k entries with its own features."""
    tmp, _, _ = trained
    export_head(tiny_pair.target_dir, tmp / "ckpt", tmp / "head")
    loaded = load_head(tiny_pair.target_dir, tmp / "ckpt")
    from safetensors.torch import load_file

    weights = load_file(str(tmp / "ckpt" / "model.safetensors"))
    cfg = json.loads((tmp / "ckpt" / "config.json").read_text())
    head = TrainableHead(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                         cfg["intermediate_size"], cfg["draft_vocab_size"])
    head.params = {k: weights[k].float() for k in head.params}
    ids = [1, 504, 6376, 314, 253, 1789, 28, 9, 77]
    n = len(ids) - 1
    feats = torch.randn(n, 3 * cfg["hidden_size"], generator=torch.Generator().manual_seed(0))
    embed = loaded.graph.w("embed").float()
    first = 2
    with torch.inference_mode():
        steps = head.steps(embed[torch.tensor(ids)], feats, cfg["rope_theta"], 3, first=first)
        fused = feats @ loaded.fc_weight.float().T
        empty = torch.zeros(1, loaded.meta["num_key_value_heads"], 0, loaded.meta["head_dim"])
        for t in range(first, n - 2):
            logits, own, key, value = loaded.graph(torch.tensor([ids[1: t + 2]]), fused[None, : t + 1],
                                                   torch.arange(t + 1)[None], empty, empty)
            for k, (begin, trained_logits) in enumerate(steps):
                if k > 0:  # the k-th drafted entry: token x_{t+1+k}, the entry before's own output
                    logits, own, key, value = loaded.graph(torch.tensor([[ids[t + 1 + k]]]), own[:, -1:],
                                                           torch.tensor([[t + k]]), key, value)
                np.testing.assert_allclose(logits[0, -1].numpy(), trained_logits[t - begin].numpy(),
                                           rtol=1e-3, atol=1e-3, err_msg=f"entry {t}, step {k}")


def test_install_converts_for_its_target_and_refuses_another_in_one_line(trained, tiny_pair):
    """The other tiny target has the same widths: only the recorded embedding sha256 tells them apart."""
    from specdec.models.head_export import HeadMismatchError
    from specdec.models.head_install import install_head

    tmp, _, _ = trained
    out = install_head(tiny_pair.target_dir, tmp / "ckpt", tmp / "installed")
    assert (out / "head.onnx").is_file() and (out / "head.json").is_file()
    with pytest.raises(HeadMismatchError) as err:
        install_head(tiny_pair.other_target_dir, tmp / "ckpt", tmp / "installed-other")
    assert "another target" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp / "installed-other").exists()


def test_soft_labels_are_the_targets_distribution_on_the_draft_vocabulary(tiny_pair):
    """The soft loss of each TTT step k is the cross-entropy of the head's draft-vocabulary logits against the
    target's own next-token distribution at the position that step drafts (renormalised on the draft
    vocabulary), recomputed here from a plain forward of the target; the argmax loss is a different number."""
    from transformers import AutoModelForCausalLM

    from specdec.distill.head_data import HeadSequence, target_features
    from specdec.distill.head_training import _sequence_loss

    target = AutoModelForCausalLM.from_pretrained(str(tiny_pair.target_dir), dtype=torch.float32).eval()
    cfg = target.config
    n = cfg.num_hidden_layers
    layers = [min(2, n), n // 2, max(n - 3, 0)]
    ids = [1, 504, 6376, 314, 253, 1789, 28, 9, 77, 330, 42]
    (seq,) = target_features(target, [HeadSequence(ids, 4)], layers, progress=lambda _: None)
    seq.loss_start = 2
    vocab = target.config.vocab_size
    vocab_ids = torch.arange(0, vocab, 3)
    to_draft = torch.full((vocab,), -1, dtype=torch.long)
    to_draft[vocab_ids] = torch.arange(len(vocab_ids))
    head = TrainableHead(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                         len(vocab_ids), seed=3)
    embed = target.get_input_embeddings().weight.detach()
    lm_rows = target.lm_head.weight.detach()[vocab_ids]
    agree, seen = [0] * 3, [0] * 3
    with torch.no_grad():
        soft = _sequence_loss(head, embed, seq, to_draft, 1e4, 3, agree, seen, lm_rows)
        hard = _sequence_loss(head, embed, seq, to_draft, 1e4, 3, [0] * 3, [0] * 3)
        target_logits = target(torch.tensor([ids])).logits[0][:, vocab_ids]  # [L, V'], the target's own
        expected = 0.0
        for k, (begin, logits) in enumerate(head.steps(embed[torch.tensor(ids)], seq.features.float(), 1e4, 3,
                                                       first=2)):
            p = target_logits[begin + 1 + k: begin + 1 + k + logits.shape[0]].softmax(-1)
            expected += 0.8 ** k * float(-(p * logits.log_softmax(-1)).sum(-1).mean())
    assert float(soft) == pytest.approx(expected, rel=2e-3)
    assert abs(float(soft) - float(hard)) > 1e-3
    assert seen == [len(ids) - 1 - 2 - k for k in range(3)]


def test_heldout_sequences_are_measured_and_kept_out(trained):
    tmp, result, _ = trained
    report = json.loads((tmp / "ckpt" / "training.json").read_text())
    assert report["heldout_sequences"] == 1 and report["sequences"] == 3 and report["soft_labels"] is True
    for point in result["curve"]:
        assert len(point["heldout_top1_per_step"]) == 3
        assert all(0.0 <= x <= 1.0 for x in point["heldout_top1_per_step"])


def test_init_from_goes_on_from_a_checkpoint(trained, tiny_pair):
    """--init-from: no training step leaves the checkpoint's weights and draft vocabulary as they were (a fresh
    start from the target would not); a checkpoint of another vocabulary size is refused, and so is a draft
    vocabulary other than the checkpoint's (before any data)."""
    from safetensors.torch import load_file

    from specdec.distill.head_training import _load_checkpoint

    tmp, _, _ = trained
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_CACHE_DIR", str(tmp / "cache"))
        train_head(tiny_pair.target_dir, tmp / "prompts.jsonl", tmp / "again", num_prompts=4, max_prompt_tokens=64,
                   max_new_tokens=16, epochs=0, ttt_steps=3, init_from=tmp / "ckpt",
                   progress=lambda _: None)
    before, after = load_file(str(tmp / "ckpt" / "model.safetensors")), load_file(str(tmp / "again" / "model.safetensors"))
    assert set(before) == set(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    vocab = json.loads((tmp / "ckpt" / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError, match="vocabulary"):
        _load_checkpoint(tmp / "ckpt", vocab + 1)
    with pytest.raises(ValueError, match="--draft-vocab 256 disagrees .* 512 tokens"):
        train_head(tiny_pair.target_dir, tmp / "prompts.jsonl", tmp / "other", draft_vocab=256, init_from=tmp / "ckpt",
                   progress=lambda _: None)
    assert not (tmp / "other").exists()


def test_a_new_artefact_replaces_an_older_install(trained, tiny_pair):
    """The install is kept while its artefact is the same, and replaced (not shadowed) once the artefact's
    weights change: the marker records the weights' sha256."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specdec.models.head_install import install_head
    from specdec_runtime.common.paths import COMPLETE_MARKER

    tmp, _, _ = trained
    artefact = tmp / "artefact"
    shutil.copytree(tmp / "ckpt", artefact)
    out = install_head(tiny_pair.target_dir, artefact, tmp / "kept")
    first = json.loads((out / COMPLETE_MARKER).read_text())
    graph = (out / "head.onnx").read_bytes()
    again = json.loads((install_head(tiny_pair.target_dir, artefact, out) / COMPLETE_MARKER).read_text())
    assert again == first  # same artefact: not exported again
    weights = load_file(str(artefact / "model.safetensors"))
    weights["norm.weight"] = weights["norm.weight"] * 2
    save_file(weights, str(artefact / "model.safetensors"))
    replaced = json.loads((install_head(tiny_pair.target_dir, artefact, out) / COMPLETE_MARKER).read_text())
    assert replaced["artefact_sha256"] != first["artefact_sha256"]
    assert (out / "head.onnx").read_bytes() != graph  # exported again from the new weights


def test_train_head_refuses_bad_input_before_any_data(trained, tiny_pair, tmp_path):
    """One line and exit 2, before any answer is generated: --init-from that is no head checkpoint (a missing
    directory, a target's directory), an output directory that already holds a head, zero epochs; and no data
    at all is an error, not an untrained checkpoint."""
    from typer.testing import CliRunner

    from specdec.cli import app

    tmp, _, _ = trained
    prompts = str(tmp / "prompts.jsonl")
    runner = CliRunner()

    def run(*args):
        result = runner.invoke(app, ["draft", "train-head", *map(str, args), "--train-prompts", prompts])
        return result.exit_code, result.output

    code, out = run(tmp_path / "a", "--init-from", tmp_path / "missing")
    assert code == 2 and "no model.safetensors" in out and "answers:" not in out, out
    target_like = tmp_path / "target-like"
    target_like.mkdir()
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(target_like / "model.safetensors"))
    code, out = run(tmp_path / "b", "--init-from", target_like)
    assert code == 2 and "not a draft head checkpoint" in out and "Traceback" not in out, out
    code, out = run(tmp / "ckpt")
    assert code == 2 and "already holds a head" in out, out
    code, out = run(tmp_path / "c", "--epochs", "0")
    assert code == 2, out
    with pytest.raises(ValueError, match="no training data"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPECDEC_CACHE_DIR", str(tmp / "cache"))
            train_head(tiny_pair.target_dir, prompts, tmp_path / "d", num_prompts=4, max_prompt_tokens=5,
                       max_new_tokens=4, epochs=1, progress=lambda _: None)
    assert not (tmp_path / "d" / "model.safetensors").exists()


def test_device_is_where_training_runs_and_cuda_without_a_gpu_is_one_line(trained, tiny_pair, tmp_path):
    """--device: the default (auto) on this machine trains on the CPU and says so; ``device="cpu"`` given
    explicitly writes the same checkpoint, bit for bit (the same seeded start, the same steps); CUDA asked for
    where torch has none is refused in one line before any data, and an unknown name too."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from specdec.cli import app

    tmp, _, lines = trained
    expected = "device: cuda" if torch.cuda.is_available() else "device: cpu"
    assert expected in lines, lines[:3]
    if not torch.cuda.is_available():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPECDEC_CACHE_DIR", str(tmp / "cache"))
            train_head(tiny_pair.target_dir, tmp / "prompts.jsonl", tmp_path / "cpu", num_prompts=4,
                       max_prompt_tokens=64, max_new_tokens=16, draft_vocab=512, epochs=4, ttt_steps=3, lr=1e-2,
                       heldout_fraction=0.25, device="cpu", progress=lambda _: None)
        a, b = load_file(str(tmp / "ckpt" / "model.safetensors")), load_file(str(tmp_path / "cpu" / "model.safetensors"))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        runner = CliRunner()
        for device, why in (("cuda", "CUDA is not available"), ("tpu", "unknown device")):
            result = runner.invoke(app, ["draft", "train-head", str(tmp_path / device), "--device", device,
                                         "--train-prompts", str(tmp / "prompts.jsonl")])
            assert result.exit_code == 2 and why in result.output and "answers:" not in result.output, result.output
            assert "Traceback" not in result.output and not (tmp_path / device).exists()
