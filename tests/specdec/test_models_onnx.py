"""Model preparation, ONNX export, the ONNX draft runner, the model drafter and vocabulary checks.

Fast tests use the session's tiny random Llama pair (conftest ``tiny_pair``); one test uses the real
SmolLM2-135M pair (``real_pair``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from specdec.models import (
    COMPLETE_MARKER,
    EXPORT_REPORT,
    DraftBuildError,
    ExportCheckError,
    ModelNotFoundError,
    default_cache_dir,
    default_model_paths,
    export_onnx_draft,
    genai_builder_available,
    resolve_draft_dir,
    resolve_target_dir,
)
from specdec_runtime.common.types import SamplingParams
from specdec_runtime.common.vocab import VocabMismatchError, check_vocab_compatible, tokenizer_fingerprint
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel


# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def tiny_target(tiny_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float32).eval()


BUILDERS = ["genai", "torch"]


@pytest.fixture(scope="module")
def torch_draft_dir(tiny_pair, tmp_path_factory):
    """The tiny target exported by the torch builder (tiny_pair.draft_dir comes from the default, genai)."""
    out = tmp_path_factory.mktemp("torch-export") / "draft"
    return export_onnx_draft(tiny_pair.target_dir, out, quantize_int8=False, progress=False, builder="torch")


@pytest.fixture(scope="module")
def draft_dirs(tiny_pair, torch_draft_dir):
    return {"genai": tiny_pair.draft_dir, "torch": torch_draft_dir}


@pytest.fixture(scope="module", params=BUILDERS)
def tiny_draft(request, draft_dirs):
    """The ONNX draft runner over each builder's export of the tiny target."""
    return OnnxDraftModel(draft_dirs[request.param], intra_op_num_threads=1)


def test_default_export_uses_genai_builder(tiny_pair):
    assert genai_builder_available(), "onnxruntime-genai is installed by scripts/install.sh"
    report = json.loads((tiny_pair.draft_dir / EXPORT_REPORT).read_text())
    assert report["builder"] == "genai"
    assert json.loads((tiny_pair.draft_dir / COMPLETE_MARKER).read_text())["builder"] == "genai"


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits[0].float().numpy()


def _hf_greedy(model, prefix, n) -> list[int]:
    seq = list(prefix)
    for _ in range(n):
        seq.append(int(_hf_logits(model, seq)[-1].argmax()))
    return seq[len(prefix) :]


def _ids(n, seed=0, vocab=49152) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, vocab, n)]


# ------------------------------------------------------------------------------------------------ export


@pytest.mark.parametrize("builder", BUILDERS)
def test_export_report_and_layout(draft_dirs, builder):
    import onnx

    d = draft_dirs[builder]
    report = json.loads((d / EXPORT_REPORT).read_text())
    assert report["builder"] == builder
    assert report["fp32_check"]["max_abs_diff"] <= 1e-4
    assert {(c["past"], c["seq"]) for c in report["fp32_check"]["cases"]} >= {(0, 1), (0, 7), (5, 1), (21, 12)}
    assert any(c.get("batch") == 2 for c in report["fp32_check"]["cases"])  # the padding case ran
    model = onnx.load(str(d / "model.onnx"), load_external_data=False)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    past = {f"past_key_values.{i}.{k}" for i in range(2) for k in ("key", "value")}
    if builder == "torch":
        assert inputs[:3] == ["input_ids", "attention_mask", "position_ids"]
    else:  # GroupQueryAttention takes positions from the mask; fused graph
        assert inputs[:2] == ["input_ids", "attention_mask"] and "position_ids" not in inputs
        ops = {n.op_type for n in model.graph.node}
        assert "GroupQueryAttention" in ops and "Concat" not in ops
    assert set(inputs[-4:]) == past and len(inputs) == len(past) + (3 if builder == "torch" else 2)
    assert outputs[0] == "logits"
    assert set(outputs[1:]) == {f"present.{i}.{k}" for i in range(2) for k in ("key", "value")}
    for name in (".specdec-complete", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (d / name).is_file(), name


def _run_by_name(sess, ids, past, past_len):
    """One raw ORT run on ids [1, S] after ``past`` {past name: array}; returns (logits, {past name: present})."""
    names = [i.name for i in sess.get_inputs()]
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, past_len + ids.shape[1]), np.int64), **past}
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(past_len, past_len + ids.shape[1])[None]
    past_names = [n for n in names if n.startswith("past_key_values.")]
    present_names = [n.replace("past_key_values.", "present.") for n in past_names]
    outs = sess.run(["logits", *present_names], feeds)
    return outs[0], dict(zip(past_names, outs[1:]))


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("past_len,seq", [(0, 1), (0, 2), (0, 9), (1, 1), (6, 1), (6, 5), (13, 30)])
def test_onnx_logits_match_hf(draft_dirs, tiny_target, builder, past_len, seq):
    """Raw ONNX Runtime run (batch 1) vs the HF model on the full sequence, with and without past."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(draft_dirs[builder] / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.asarray(_ids(past_len + seq, seed=past_len * 100 + seq), dtype=np.int64)
    ref = _hf_logits(tiny_target, ids)
    past = {n.name: np.zeros((1, 2, 0, 16), np.float32) for n in sess.get_inputs() if n.name.startswith("past")}
    if past_len:
        _, past = _run_by_name(sess, ids[None, :past_len], past, 0)
    logits, present = _run_by_name(sess, ids[None, past_len:], past, past_len)
    assert logits.shape == (1, seq, 49152)
    assert present["past_key_values.1.value"].shape == (1, 2, past_len + seq, 16)
    np.testing.assert_allclose(logits[0], ref[past_len:], atol=1e-4, rtol=0)


def test_genai_batch_with_right_padding(tiny_pair, tiny_target):
    """The GenAI graph (GroupQueryAttention) reads each row's length from a right-padded mask."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tiny_pair.draft_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    a, b = _ids(7, seed=1), _ids(4, seed=2)
    feeds = {
        "input_ids": np.array([a, b + [2, 2, 2]], np.int64),
        "attention_mask": np.array([[1] * 7, [1, 1, 1, 1, 0, 0, 0]], np.int64),
    }
    feeds.update({n.name: np.zeros((2, 2, 0, 16), np.float32) for n in sess.get_inputs() if n.name.startswith("past")})
    logits = sess.run(["logits"], feeds)[0]
    np.testing.assert_allclose(logits[0], _hf_logits(tiny_target, a), atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits[1, :4], _hf_logits(tiny_target, b), atol=1e-4, rtol=0)


def test_torch_export_batch_with_left_padding(torch_draft_dir, tiny_target):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(torch_draft_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    a, b = _ids(7, seed=1), _ids(4, seed=2)
    feeds = {
        "input_ids": np.array([a, [2, 2, 2] + b], np.int64),
        "attention_mask": np.array([[1] * 7, [0, 0, 0, 1, 1, 1, 1]], np.int64),
        "position_ids": np.array([list(range(7)), [0, 0, 0, 0, 1, 2, 3]], np.int64),
    }
    feeds.update({n.name: np.zeros((2, 2, 0, 16), np.float32) for n in sess.get_inputs() if n.name.startswith("past")})
    logits = sess.run(["logits"], feeds)[0]
    np.testing.assert_allclose(logits[0], _hf_logits(tiny_target, a), atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits[1, 3:], _hf_logits(tiny_target, b), atol=1e-4, rtol=0)


def test_export_is_idempotent(tiny_pair):
    before = (tiny_pair.draft_dir / "model.onnx").stat().st_mtime_ns
    assert export_onnx_draft(tiny_pair.target_dir, tiny_pair.draft_dir, quantize_int8=False, progress=False) == (
        tiny_pair.draft_dir
    )
    assert (tiny_pair.draft_dir / "model.onnx").stat().st_mtime_ns == before


@pytest.mark.slow  # > 10 s here (measured): the full suite runs it, the quick tier does not
def test_export_check_failure_raises_and_leaves_nothing(tiny_pair, tmp_path, monkeypatch):
    from specdec.models import onnx_check  # the module whose code reads it

    monkeypatch.setattr(onnx_check, "FP32_TOLERANCE", 0.0)
    out = tmp_path / "bad"
    with pytest.raises(ExportCheckError, match="max \\|logit diff\\|"):
        export_onnx_draft(tiny_pair.target_dir, out, quantize_int8=False, progress=False)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".specdec-tmp")]


def test_builder_choice_and_fallback(tiny_pair, tmp_path, monkeypatch):
    from specdec.models import onnx_export  # the module whose code calls it

    with pytest.raises(ValueError, match="builder must be one of"):
        export_onnx_draft(tiny_pair.target_dir, tmp_path / "x", builder="optimum", progress=False)
    assert not (tmp_path / "x").exists()
    monkeypatch.setattr(onnx_export, "genai_builder_available", lambda: False)
    with pytest.raises(DraftBuildError, match="onnxruntime-genai is not installed"):
        export_onnx_draft(tiny_pair.target_dir, tmp_path / "g", quantize_int8=False, progress=False, builder="genai")
    assert not (tmp_path / "g").exists()
    out = export_onnx_draft(tiny_pair.target_dir, tmp_path / "a", quantize_int8=False, progress=False)
    report = json.loads((out / EXPORT_REPORT).read_text())
    assert report["builder"] == "torch" and "not installed" in report["genai_builder_error"]
    assert report["fp32_check"]["max_abs_diff"] <= 1e-4


def test_stale_default_draft_is_detected(draft_dirs, tmp_path):
    from specdec.models.prepare import INT8_BLOCK_SIZE, stale_default_draft

    assert stale_default_draft(draft_dirs["torch"]) is True  # prepare_models re-exports it with genai
    assert stale_default_draft(draft_dirs["genai"]) is False
    assert stale_default_draft(tmp_path / "missing") is False
    old = tmp_path / "old-int8"
    shutil.copytree(draft_dirs["genai"], old)
    marker = json.loads((old / COMPLETE_MARKER).read_text())
    marker.update(quantized_int8=True, int8={"block_size": 32})
    (old / COMPLETE_MARKER).write_text(json.dumps(marker))
    assert stale_default_draft(old) is True
    marker["int8"]["block_size"] = INT8_BLOCK_SIZE
    (old / COMPLETE_MARKER).write_text(json.dumps(marker))
    assert stale_default_draft(old) is False
    # a torch fallback because the installed builder failed on this model is not re-tried on every prepare
    torch_marker = json.loads((draft_dirs["torch"] / COMPLETE_MARKER).read_text())
    torch_marker.update(genai_builder_failed=True)
    (old / COMPLETE_MARKER).write_text(json.dumps(torch_marker))
    assert stale_default_draft(old) is False


def test_failing_genai_builder_falls_back_and_is_recorded(tiny_pair, tmp_path, monkeypatch):
    from specdec.models import onnx_export, prepare

    def broken(hf_dir, out_dir, timeout_s=0):
        raise DraftBuildError("onnxruntime-genai model builder failed (exit 1): NotImplementedError: arch")

    monkeypatch.setattr(onnx_export, "_export_fp32_genai", broken)
    out = export_onnx_draft(tiny_pair.target_dir, tmp_path / "fb", quantize_int8=False, progress=False)
    marker = json.loads((out / COMPLETE_MARKER).read_text())
    assert marker["builder"] == "torch" and marker["genai_builder_failed"] is True
    assert not prepare.stale_default_draft(out)


def test_invalid_draft_directories_give_one_line_errors(draft_dirs, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(draft_dirs["genai"], bad)
    (bad / "model.onnx").write_bytes(b"not an onnx file")
    with pytest.raises(ModelNotFoundError, match="is not a loadable ONNX model"):
        OnnxDraftModel(bad)
    nocfg = tmp_path / "nocfg"
    shutil.copytree(draft_dirs["genai"], nocfg)
    cfg = json.loads((nocfg / "config.json").read_text())
    for key in ("hidden_size", "head_dim"):  # the GenAI graph leaves the head dimension symbolic
        cfg.pop(key, None)
    (nocfg / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelNotFoundError, match="config.json lacks 'hidden_size'"):
        OnnxDraftModel(nocfg)


def test_feeding_past_the_draft_context_is_a_clear_error(draft_dirs):
    m = OnnxDraftModel(draft_dirs["genai"], intra_op_num_threads=1)
    ctx = m.max_position_embeddings
    assert ctx == 512
    m.forward(_ids(ctx - 1))
    with pytest.raises(ValueError, match="exceed the draft's context of 512 tokens"):
        m.forward(_ids(2))
    assert m.num_cached == ctx - 1
    m.forward(_ids(1))  # exactly at the limit is fine


@pytest.mark.slow  # > 10 s here (measured): the full suite runs it, the quick tier does not
@pytest.mark.parametrize("builder", BUILDERS)
def test_int8_export_runs_and_reports_agreement(tiny_pair, tmp_path, builder):
    out = export_onnx_draft(tiny_pair.target_dir, tmp_path / "int8", quantize_int8=True, progress=False,
                            builder=builder)
    report = json.loads((out / EXPORT_REPORT).read_text())
    assert report["int8"]["method"] == "matmul_nbits" and report["builder"] == builder
    if builder == "genai":  # the tied LM head's Transpose was folded so the head is quantized too
        import onnx

        assert report["folded_transposes"] == 1
        ops = [n.op_type for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node]
        assert "Transpose" not in ops and ops.count("MatMulNBits") == 2 * 5 + 1  # (qkv, o, gate, up, down) × 2 layers + LM head
    assert 0.0 <= report["int8_check"]["top1_agreement"] <= 1.0
    assert report["int8_check"]["greedy_agreement"] >= 0.5
    model = OnnxDraftModel(out, intra_op_num_threads=1)
    assert model.forward(_ids(5)).shape == (5, 49152)


# ------------------------------------------------------------------------------------------------ runner


def test_draft_model_attributes(tiny_draft):
    assert tiny_draft.vocab_size == 49152
    assert tiny_draft.num_layers == 2 and tiny_draft.num_kv_heads == 2 and tiny_draft.head_dim == 16
    assert len(tiny_draft.tokenizer) == 49152
    assert "CPUExecutionProvider" in tiny_draft.providers


def test_forward_and_rollback_match_fresh_prefix(tiny_draft, tiny_target):
    ids = _ids(40, seed=3)
    ref = _hf_logits(tiny_target, ids)
    m = tiny_draft
    m.reset()
    out = m.forward(ids[:10])
    assert out.shape == (10, 49152) and out.dtype == np.float32 and m.num_cached == 10
    np.testing.assert_allclose(out, ref[:10], atol=1e-4, rtol=0)
    for t in range(10, 20):  # single-token steps
        np.testing.assert_allclose(m.forward([ids[t]])[0], ref[t], atol=1e-4, rtol=0)
    # Feed garbage, roll it back, continue with the real tokens: same logits as a fresh prefix.
    m.forward(_ids(7, seed=99))
    assert m.num_cached == 27
    m.rollback(20)
    assert m.num_cached == 20
    np.testing.assert_allclose(m.forward(ids[20:30]), ref[20:30], atol=1e-4, rtol=0)
    m.rollback(5)
    np.testing.assert_allclose(m.forward(ids[5:40]), ref[5:40], atol=1e-4, rtol=0)
    m.rollback(0)
    assert m.num_cached == 0
    np.testing.assert_allclose(m.forward(ids[:3]), ref[:3], atol=1e-4, rtol=0)
    m.rollback(3)  # no-op
    with pytest.raises(ValueError):
        m.rollback(4)
    with pytest.raises(ValueError):
        m.rollback(-1)
    with pytest.raises(ValueError):
        m.forward([])
    with pytest.raises(ValueError):
        m.forward([49152])
    m.reset()
    assert m.num_cached == 0


def test_shared_kv_buffer_matches_copying_runner(draft_dirs):
    """GenAI graphs run with in-place KV buffers (IOBinding); logits equal the copying path's, across buffer
    growth (256 -> 512 positions; the tiny model's context is 512) and roll-backs."""
    shared = OnnxDraftModel(draft_dirs["genai"], intra_op_num_threads=1)
    copying = OnnxDraftModel(draft_dirs["genai"], intra_op_num_threads=1, share_kv_buffer=False)
    assert shared.share_kv_buffer and not copying.share_kv_buffer
    assert not OnnxDraftModel(draft_dirs["torch"], intra_op_num_threads=1).share_kv_buffer
    with pytest.raises(ValueError, match="GroupQueryAttention"):
        OnnxDraftModel(draft_dirs["torch"], share_kv_buffer=True)
    ids = _ids(500, seed=11)
    steps = [(0, 200), (200, 250), (250, 257), (257, 258), ("rollback", 240), (240, 400), ("rollback", 100),
             (100, 101), (101, 500)]
    for a, b in steps:
        if a == "rollback":
            shared.rollback(b)
            copying.rollback(b)
            continue
        np.testing.assert_array_equal(shared.forward(ids[a:b]), copying.forward(ids[a:b]))
        assert shared.num_cached == copying.num_cached == b
    assert shared._buffers[0].shape[2] == 512
    shared.reset()
    copying.reset()
    np.testing.assert_array_equal(shared.forward(ids[:5]), copying.forward(ids[:5]))


# ------------------------------------------------------------------------------------------------ drafter


def test_greedy_drafter_matches_hf_greedy(tiny_draft, tiny_target):
    drafter = ModelDrafter(tiny_draft)
    greedy = SamplingParams(temperature=0.0)
    prompt = _ids(12, seed=4)
    block = drafter.propose(prompt, 6, greedy)
    assert block.draft_probs is None and block.draft_ms > 0
    assert block.draft_token_ids == _hf_greedy(tiny_target, prompt, 6)

    # Verifier accepts 2 and sends a different token: the drafter resyncs by rolling back.
    committed = prompt + block.draft_token_ids[:2] + [7]
    block = drafter.propose(committed, 5, greedy)
    assert block.draft_token_ids == _hf_greedy(tiny_target, committed, 5)
    assert tiny_draft.num_cached == len(committed) + 4  # committed + the first γ-1 draft tokens

    # Full block accepted + bonus (the proactive-drafting bet), then a completely different prompt.
    committed = committed + block.draft_token_ids + [11]
    assert drafter.propose(committed, 4, greedy).draft_token_ids == _hf_greedy(tiny_target, committed, 4)
    other = _ids(5, seed=5)
    assert drafter.propose(other, 3, greedy).draft_token_ids == _hf_greedy(tiny_target, other, 3)
    assert drafter.propose([42], 2, greedy).draft_token_ids == _hf_greedy(tiny_target, [42], 2)
    assert drafter.propose([42], 0, greedy).draft_token_ids == []

    # draft_top_k <= 1 means greedy drafting even for sampled sessions.
    sampled = SamplingParams(temperature=0.8, seed=1)
    block = ModelDrafter(tiny_draft, draft_top_k=1).propose(prompt, 4, sampled)
    assert block.draft_probs is None and block.draft_token_ids == _hf_greedy(tiny_target, prompt, 4)


def test_topk_drafting_samples_inside_q(tiny_draft):
    drafter = ModelDrafter(tiny_draft, draft_top_k=8)
    prompt = _ids(9, seed=6)
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.3),
    ):
        for seed in range(4):
            block = drafter.propose(prompt, 5, dataclasses.replace(params, seed=seed))
            q = block.draft_probs
            assert q is not None and q.token_ids.dtype == np.int64 and q.probs.dtype == np.float32
            assert q.token_ids.shape == q.probs.shape and q.token_ids.shape[0] == 5
            assert q.token_ids.shape[1] <= 8 and (params.top_k == 0 or q.token_ids.shape[1] <= params.top_k)
            np.testing.assert_allclose(q.probs.sum(axis=1), 1.0, atol=1e-5)
            for i, tok in enumerate(block.draft_token_ids):
                row = q.token_ids[i]
                assert len(set(row.tolist())) == len(row)  # distinct ids (padding included)
                assert tok in row and q.probs[i][row.tolist().index(tok)] > 0
            # Reproducible: same seed, same block.
            again = drafter.propose(prompt, 5, dataclasses.replace(params, seed=seed))
            assert again.draft_token_ids == block.draft_token_ids
            np.testing.assert_array_equal(again.draft_probs.token_ids, q.token_ids)


def test_topk_drafting_uses_the_shared_sampling_maths(tiny_draft):
    """The first draft token is exactly ids[sample_from(normalize_sparse(q), uniform(seed, pos, DRAFT))] with q
    = draft_topk_distribution of the draft's logits: the reference composition's ids, its q up to rounding."""
    from specdec_runtime.common.sampling import (Stream, draft_topk_distribution, logits_to_probs, normalize_sparse, sample_from,
                                 draft_topk_from_probs, uniform)

    params = SamplingParams(temperature=1.0, seed=3)
    prompt = _ids(6, seed=7)
    tiny_draft.reset()
    logits = tiny_draft.forward(prompt)[-1]
    ids, q = draft_topk_distribution(logits, params, 4, 49152)
    ref_ids, ref_q = draft_topk_from_probs(logits_to_probs(logits[None], params, 49152)[0], 4)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(q, ref_q, rtol=1e-6)
    expected = int(ids[sample_from(normalize_sparse(q), uniform(3, len(prompt), Stream.DRAFT_SAMPLE))])
    block = ModelDrafter(tiny_draft, draft_top_k=4).propose(prompt, 1, params)
    assert block.draft_token_ids == [expected]
    np.testing.assert_array_equal(block.draft_probs.token_ids[0], ids)
    np.testing.assert_array_equal(block.draft_probs.probs[0], q)


def test_valid_vocab_size_masks_padded_ids(tiny_draft):
    drafter = ModelDrafter(tiny_draft, draft_top_k=8, valid_vocab_size=100)
    assert drafter.valid_vocab_size == 100
    block = drafter.propose(_ids(5, seed=8), 4, SamplingParams(temperature=2.0, seed=0))
    assert (block.draft_probs.token_ids < 100).all() and max(block.draft_token_ids) < 100
    assert max(drafter.propose(_ids(5, seed=8), 4, SamplingParams()).draft_token_ids) < 100
    with pytest.raises(ValueError):
        ModelDrafter(tiny_draft, valid_vocab_size=49153)


def test_bad_draft_disagrees(tiny_pair, tiny_target):
    bad = ModelDrafter(OnnxDraftModel(tiny_pair.other_draft_dir, intra_op_num_threads=1))
    prompt = _ids(8, seed=9)
    block = bad.propose(prompt, 8, SamplingParams())
    assert block.draft_token_ids != _hf_greedy(tiny_target, prompt, 8)


# ------------------------------------------------------------------------------------------------ vocab


def _swapped_tokenizer(src, dst, a=1000, b=1001):
    """Copy of the tokenizer at ``src`` with the tokens of ids a and b swapped (same size, same strings)."""
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    inv = {v: k for k, v in vocab.items()}
    vocab[inv[a]], vocab[inv[b]] = b, a
    (dst / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return AutoTokenizer.from_pretrained(str(dst)), inv[a], inv[b]


def test_vocab_checks(smollm2_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    same = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    assert check_vocab_compatible(tok, same, 49152, 49152) == 49152
    assert check_vocab_compatible(tok, same, 49152, 49216) == 49152  # padded target embedding rows
    fp = tokenizer_fingerprint(tok)
    assert fp == tokenizer_fingerprint(same) and len(fp) == 16 and int(fp, 16) >= 0

    swapped, tok_a, tok_b = _swapped_tokenizer(smollm2_tokenizer_dir, tmp_path / "swapped")
    assert len(swapped) == len(tok)
    assert tokenizer_fingerprint(swapped) != fp
    with pytest.raises(VocabMismatchError, match="token id 1000") as err:
        check_vocab_compatible(swapped, tok, 49152, 49152)
    msg = str(err.value)
    assert "\n" not in msg and repr(tok_a) in msg and repr(tok_b) in msg
    assert isinstance(err.value, ValueError)

    extra = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    extra.add_tokens(["<|specdec_extra|>"])
    with pytest.raises(VocabMismatchError, match="token id 49152"):
        check_vocab_compatible(extra, tok, 49153, 49152)
    with pytest.raises(VocabMismatchError, match="target model has 49000 logits"):
        check_vocab_compatible(tok, same, 49152, 49000)


# ------------------------------------------------------------------------------------------------ paths


def test_missing_dirs_raise_model_not_found(tmp_path, tiny_pair):
    with pytest.raises(ModelNotFoundError, match="no HF causal-LM directory at .*specdec models prepare"):
        resolve_target_dir(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match=r"no ONNX draft \(model.onnx\) at"):
        resolve_draft_dir(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError):
        OnnxDraftModel(tmp_path / "nope")
    # An HF dir is not a draft, and a draft is not an HF target.
    with pytest.raises(ModelNotFoundError):
        resolve_draft_dir(tiny_pair.target_dir)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError):
        resolve_target_dir(partial)
    assert issubclass(ModelNotFoundError, ValueError)
    assert resolve_target_dir(tiny_pair.target_dir) == tiny_pair.target_dir.resolve()
    assert resolve_draft_dir(tiny_pair.draft_dir / "model.onnx") == tiny_pair.draft_dir.resolve()


def test_default_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    paths = default_model_paths()
    assert paths.target_dir == tmp_path / "smollm2-135m-instruct"
    assert paths.draft_dir == tmp_path / "smollm2-135m-instruct-onnx-int8"
    monkeypatch.delenv("SPECDEC_CACHE_DIR")
    assert default_cache_dir() == __import__("pathlib").Path.home() / ".cache" / "specdec"


# ------------------------------------------------------------------------------------------------ real


@pytest.mark.real_model
def test_real_pair_export_report_and_int8_agreement(real_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = json.loads((real_pair.draft_dir / EXPORT_REPORT).read_text())
    assert report["num_layers"] == 30 and report["vocab_size"] == 49152
    assert report["fp32_check"]["max_abs_diff"] <= 1e-3
    assert any(c["seq"] == 1 and c["past"] > 0 for c in report["fp32_check"]["cases"])
    assert report["quantized_int8"] and report["int8_check"]["top1_agreement"] >= 0.8
    assert report["model_bytes"] < 400e6

    target_tok = AutoTokenizer.from_pretrained(real_pair.target_dir)
    draft = OnnxDraftModel(real_pair.draft_dir)
    assert check_vocab_compatible(draft.tokenizer, target_tok, draft.vocab_size, 49152) == 49152
    assert tokenizer_fingerprint(draft.tokenizer) == tokenizer_fingerprint(target_tok)

    target = AutoModelForCausalLM.from_pretrained(real_pair.target_dir, dtype=torch.float32).eval()
    prompt = target_tok.apply_chat_template(
        [{"role": "user", "content": "Name three colours of the rainbow."}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    target_tokens = out[0, len(prompt) :].tolist()
    # Teacher-forced along the target's greedy continuation: one greedy draft token per committed prefix.
    drafter = ModelDrafter(draft)
    agree = [
        drafter.propose(prompt + target_tokens[:i], 1, SamplingParams()).draft_token_ids[0] == target_tokens[i]
        for i in range(len(target_tokens))
    ]
    assert np.mean(agree) >= 0.75, (np.mean(agree), target_tokens)
    # A 4-token greedy block from the prompt follows the target's continuation for at least its first token.
    block = drafter.propose(prompt, 4, SamplingParams())
    assert block.draft_token_ids[0] == target_tokens[0]

