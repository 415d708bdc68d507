"""Draft distillation (specdec.distill) and the distilled-draft install path (specdec.models), on a tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specdec.models import (  # noqa: E402
    DISTILLED_MASKED_LOGIT,
    build_distilled_draft,
    install_distilled_draft,
    load_distilled_draft,
    save_distilled_artefact,
)
from specdec import distill as D  # noqa: E402
from specdec.bench.prompts import load_prompts  # noqa: E402

PROMPTS = [
    "Name three colours.",
    "What is two plus two?",
    "Write a haiku about the sea.",
    "Translate 'good morning' to French.",
    "Give a synonym of happy.",
    "List the days of the week.",
    "Say hello.",
    "Why is the sky blue?",
    "Count to five.",
    "What is the capital of Italy?",
    "Describe a cat in one sentence.",
    "Spell the word apple backwards.",
]


def _tiny_target(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_tokenizer_dir):
    """A tiny target HF dir, a prompts file and generated target data (shared by the tests)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("distill")
    target_dir = root / "target"
    _tiny_target().save_pretrained(target_dir)
    AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir)).save_pretrained(target_dir)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = root / "run"
    D.generate_target_data(target_dir, out / "data", [q.prompt for q in load_prompts(prompts)], heldout_frac=0.25,
                           batch_size=4, chunk_batches=1, max_new_tokens=12, topk=8, gen_dtype="float32",
                           progress=False)
    return {"target_dir": target_dir, "prompts": prompts, "out": out}


def test_generated_data_is_the_targets_greedy_answer(tiny):
    from transformers import AutoModelForCausalLM

    train, held = D.load_data(tiny["out"] / "data")
    assert train and held
    target = AutoModelForCausalLM.from_pretrained(str(tiny["target_dir"])).eval()
    r = train[0]
    ids = torch.cat([r["prompt_ids"], r["answer_ids"]]).long()[None]
    with torch.no_grad():
        logits = target(input_ids=ids).logits[0]
    p = len(r["prompt_ids"])
    pred = logits[p - 1 : -1].argmax(-1)
    assert (pred == r["answer_ids"].long()).all()
    assert r["topk_ids"].shape == (len(r["answer_ids"]), 8)
    assert (r["topk_ids"][:, 0].long() == r["answer_ids"].long()).all()


def test_distill_reduces_loss_and_resumes(tiny):
    out = tiny["out"]
    kw = dict(train_prompts=tiny["prompts"], num_layers=2, head_vocab=512, time_budget_s=1e6, progress=False,
              generate_data=False, batch_tokens=256, lr=3e-3, threads=1, export=False, eval_every_s=1e9)
    r1 = D.distill(tiny["target_dir"], out, max_steps=6, **kw)
    assert r1["steps"] == 6
    first, last = r1["evals"][0]["loss"], r1["heldout"]["loss"]
    # on the training data itself the loss must go down
    r2 = D.distill(tiny["target_dir"], out, max_steps=12, **kw)  # resumes at step 6
    assert r2["steps"] == 12
    assert len(r2["evals"]) >= 2 and r2["evals"][0]["step"] == 0
    train, _ = D.load_data(out / "data")
    ckpt = torch.load(out / D.CKPT_FILE, weights_only=False)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(tiny["target_dir"])).eval()
    fresh = build_distilled_draft(target, 2, ckpt["head_ids"], init_layer_ids=ckpt["init_layer_ids"])
    trained = build_distilled_draft(target, 2, ckpt["head_ids"], layer_state=ckpt["model"])
    lut = torch.full((49152,), -1, dtype=torch.long)
    lut[torch.as_tensor(ckpt["head_ids"])] = torch.arange(len(ckpt["head_ids"]))
    before = D.evaluate(fresh, train, 2, lut)["loss"]
    after = D.evaluate(trained, train, 2, lut)["loss"]
    assert after < before * 0.95, (before, after, first, last)


def test_distill_shard_cap_and_step_schedule(tiny, tmp_path):
    """data_max_shards generates only the first shards of the plan (held-out first); with max_steps the cosine
    schedule runs over the steps (a clock-driven one with this huge time budget would still be warming up at
    2 % of the peak); the loss on the training answers falls."""
    peak = 3e-3
    r = D.distill(tiny["target_dir"], tmp_path, train_prompts=tiny["prompts"], num_layers=2, head_vocab=512,
                  time_budget_s=1e6, progress=False, max_new_tokens=8, gen_batch_size=2, gen_dtype="float32",
                  heldout_frac=0.25, data_max_shards=2, batch_tokens=128, lr=peak, threads=1, export=False,
                  eval_every_s=1e9, max_steps=4)
    plan = json.loads((tmp_path / "data" / "plan.json").read_text())
    assert [s["heldout"] for s in plan["shards"][:2]] == [True, False] and len(plan["shards"]) > 2
    assert sorted(p.name for p in (tmp_path / "data").glob("shard_*.pt")) == ["shard_00000.pt", "shard_00001.pt"]
    assert r["train_records"] == len(plan["shards"][1]["prompts"]) and r["steps"] == 4
    lr_last = torch.load(tmp_path / D.CKPT_FILE, weights_only=False)["opt"]["param_groups"][0]["lr"]
    assert 0.1 * peak < lr_last < 0.5 * peak, lr_last  # step 4 of 4 runs at frac 3/4 of the cosine
    train, _ = D.load_data(tmp_path / "data")
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(tiny["target_dir"])).eval()
    ckpt = torch.load(tmp_path / D.CKPT_FILE, weights_only=False)
    lut = torch.full((49152,), -1, dtype=torch.long)
    lut[torch.as_tensor(ckpt["head_ids"])] = torch.arange(len(ckpt["head_ids"]))
    fresh = build_distilled_draft(target, 2, ckpt["head_ids"], init_layer_ids=ckpt["init_layer_ids"])
    trained = build_distilled_draft(target, 2, ckpt["head_ids"], layer_state=ckpt["model"])
    assert D.evaluate(trained, train, 2, lut)["loss"] < D.evaluate(fresh, train, 2, lut)["loss"]


def test_frspec_head_masks_outside_its_vocabulary():
    target = _tiny_target()
    head = [0, 2, 5, 17, 100, 4000]
    draft = build_distilled_draft(target, 2, head)
    ids = torch.tensor([[1, 5, 17, 9, 3]])
    with torch.no_grad():
        logits = draft(input_ids=ids).logits[0]
        hidden = draft.model(input_ids=ids).last_hidden_state[0]
    outside = torch.ones(49152, dtype=torch.bool)
    outside[head] = False
    assert (logits[:, outside] == DISTILLED_MASKED_LOGIT).all()
    # inside: the tied LM head rows of the target
    ref = hidden @ target.model.embed_tokens.weight[head].T
    assert torch.allclose(logits[:, head], ref, atol=1e-5)
    probs = torch.softmax(logits.double(), -1)
    assert (probs[:, outside] == 0).all()


def test_artefact_install_reproduces_the_draft_and_onnx_matches(tiny, tmp_path):
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(tiny["target_dir"])).eval()
    head = list(range(0, 3000, 3))
    draft = build_distilled_draft(target, 2, head)
    with torch.no_grad():  # make it differ from its initialisation
        for p in draft.model.layers.parameters():
            p.add_(0.01 * torch.randn_like(p))
    art = save_distilled_artefact(draft, target, tmp_path / "art")
    files = sorted(f.name for f in art.iterdir())
    assert files == ["draft_config.json", "draft_weights.safetensors"]
    size = sum(f.stat().st_size for f in art.iterdir())
    assert size < 0.5 * sum(p.numel() * 2 for p in draft.model.parameters())  # no embedding stored
    rebuilt = load_distilled_draft(target, art)
    ids = torch.tensor([[1, 30, 400, 5000, 7, 2]])
    with torch.no_grad():
        a = draft(input_ids=ids).logits
        b = rebuilt(input_ids=ids).logits
    assert torch.allclose(a[..., head], b[..., head], atol=2e-2)  # fp16 storage
    assert (a.argmax(-1) == b.argmax(-1)).all()

    onnx_dir = install_distilled_draft(tiny["target_dir"], art, tmp_path / "onnx", progress=False)
    rep = json.loads((onnx_dir / "specdec_export.json").read_text())
    assert rep["fp32_check"]["max_abs_diff"] <= 1e-3
    sess = ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"] and "past_key_values.1.value" in names
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy()),
             "position_ids": np.arange(ids.shape[1])[None]}
    feeds.update({n: np.zeros((1, 2, 0, 16), np.float32) for n in names[3:]})
    logits = sess.run(["logits"], feeds)[0]
    assert logits.shape == (1, ids.shape[1], 49152)
    assert np.abs(logits[..., head] - b[..., head].numpy()).max() < 1e-3
    outside = np.ones(49152, bool)
    outside[head] = False
    assert (logits[..., outside] <= DISTILLED_MASKED_LOGIT / 2).all()
    # the edge runner accepts it and drafts only inside the head vocabulary
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    m = OnnxDraftModel(onnx_dir, providers=["CPUExecutionProvider"])
    row = m.forward([1, 30, 400])[-1]
    assert int(np.argmax(row)) in set(head)


def test_artefact_refuses_another_target(tiny, tmp_path):
    target = _tiny_target(0)
    other = _tiny_target(1)
    art = save_distilled_artefact(build_distilled_draft(target, 1, [0, 1, 2]), target, tmp_path / "a")
    with pytest.raises(ValueError):
        load_distilled_draft(other, art)


def test_frequent_token_ids():
    recs = [{"answer_ids": torch.tensor([7, 7, 7, 9, 9, 11]), "prompt_ids": torch.tensor([50, 50])}]
    ids = D.frequent_token_ids(recs, 100, 4, always=(2,))
    assert ids == [2, 7, 9, 11]
    ids = D.frequent_token_ids(recs, 100, 6, always=(2,))
    assert ids == [0, 2, 7, 9, 11, 50]
