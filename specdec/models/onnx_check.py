"""The export checks of an ONNX draft: fp32 ONNX logits vs PyTorch at several (past, seq) shapes (and padded
batches), int8 top-1 / greedy agreement; and running an exported graph with ONNX Runtime (its I/O names and KV
shapes: the text-generation-with-past layout of :mod:`specdec.models`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

FP32_TOLERANCE = 1e-3  # max abs logit difference ONNX fp32 vs PyTorch accepted at export

# A natural text for the export checks (tokenized with the model's own tokenizer).
_CHECK_TEXT = (
    "Speculative decoding lets a small draft model propose several tokens that a large target model then "
    "verifies in a single forward pass. When the draft guesses well, the target commits many tokens per "
    "step, and the output is distributed exactly as if the target had generated alone. The quick brown fox "
    "jumps over the lazy dog, and 1 + 2 = 3."
)



class ExportCheckError(RuntimeError):
    """The exported ONNX model does not reproduce the PyTorch logits within tolerance."""



def kv_shape(config: Any) -> tuple[int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"]
    for i in range(num_layers):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def ort_session(onnx_path: Path, threads: int | None = None) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    # Export checks interleave ORT runs with PyTorch: no busy-waiting ORT threads stealing PyTorch's cores.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])


def ort_run(sess: Any, ids: np.ndarray, past: list[np.ndarray] | None, num_layers: int, kv: tuple[int, int]):
    """Run the exported model on ids [B, S] after ``past`` (flat list of 2L arrays, or None = no past)."""
    batch, seq = ids.shape
    if past is None:
        past = [np.zeros((batch, kv[0], 0, kv[1]), np.float32) for _ in range(2 * num_layers)]
    past_len = past[0].shape[2]
    in_names, out_names = io_names(num_layers)
    feeds = {
        "input_ids": ids.astype(np.int64),
        "attention_mask": np.ones((batch, past_len + seq), np.int64),
    }
    if _has_input(sess, "position_ids"):
        positions = np.arange(past_len, past_len + seq, dtype=np.int64)
        feeds["position_ids"] = np.broadcast_to(positions, (batch, seq)).copy()
    feeds.update(zip(in_names[3:], past))
    outs = sess.run(out_names, feeds)  # by name: the GenAI builder orders all keys before all values
    return outs[0], outs[1:]


def _has_input(sess: Any, name: str) -> bool:
    return any(i.name == name for i in sess.get_inputs())


def _check_ids(tokenizer: Any, vocab_size: int, n: int) -> np.ndarray:
    ids: list[int] = []
    if tokenizer is not None:
        ids = [i for i in tokenizer(_CHECK_TEXT)["input_ids"] if i < vocab_size]
    rng = np.random.default_rng(0)
    while len(ids) < n:
        ids.append(int(rng.integers(0, vocab_size)))
    return np.asarray(ids[:n], dtype=np.int64)


# (past length, new tokens) cases of the fp32 check: seq 1 and seq > 1, with and without past.
_CHECK_CASES = ((0, 1), (0, 2), (0, 7), (0, 33), (5, 1), (5, 3), (21, 1), (21, 12), (40, 1))


def check_fp32(sess: Any, model: Any, tokenizer: Any) -> dict[str, Any]:
    """Compare ONNX logits with PyTorch logits of the full sequence (no cache) on every case."""
    import torch

    cfg = model.config
    num_layers, kv = cfg.num_hidden_layers, kv_shape(cfg)
    total = max(p + s for p, s in _CHECK_CASES)
    ids = _check_ids(tokenizer, cfg.vocab_size, total)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids)[None]).logits[0].float().numpy()
    cases = []
    for past_len, seq in _CHECK_CASES:
        past = None
        if past_len:
            _, past = ort_run(sess, ids[None, :past_len], None, num_layers, kv)
        logits, _ = ort_run(sess, ids[None, past_len : past_len + seq], past, num_layers, kv)
        diff = float(np.abs(logits[0] - ref[past_len : past_len + seq]).max())
        cases.append({"past": past_len, "seq": seq, "max_abs_diff": diff})
    # Batch of 2 with padding on row 1 (the attention_mask path): left padding for the torch graph (explicit
    # position_ids); right padding for the GenAI graph, whose GroupQueryAttention reads each row's length from
    # the mask and positions from 0 (the layout its runtime uses).
    seq = 6
    in_names, _ = io_names(num_layers)
    left = _has_input(sess, "position_ids")
    feeds_mask = np.ones((2, seq), np.int64)
    if left:
        rows = np.stack([ids[:seq], np.concatenate([[0, 0], ids[: seq - 2]])])
        feeds_mask[1, :2] = 0
    else:
        rows = np.stack([ids[:seq], np.concatenate([ids[: seq - 2], [0, 0]])])
        feeds_mask[1, -2:] = 0
    feeds = {"input_ids": rows.astype(np.int64), "attention_mask": feeds_mask}
    if left:
        feeds["position_ids"] = np.stack(
            [np.arange(seq), np.concatenate([[1, 1], np.arange(seq - 2)])]).astype(np.int64)
    feeds.update({n: np.zeros((2, kv[0], 0, kv[1]), np.float32) for n in in_names[3:]})
    logits = sess.run(["logits"], feeds)[0]
    row1 = logits[1, 2:] if left else logits[1, : seq - 2]
    diff_pad = max(float(np.abs(logits[0] - ref[:seq]).max()), float(np.abs(row1 - ref[: seq - 2]).max()))
    cases.append({"past": 0, "seq": seq, "batch": 2, "left_padding" if left else "right_padding": 2,
                  "max_abs_diff": diff_pad})
    return {
        "max_abs_diff": max(c["max_abs_diff"] for c in cases),
        "tolerance": FP32_TOLERANCE,
        "logit_abs_max": float(np.abs(ref).max()),
        "cases": cases,
    }


_CHECK_PROMPT = "Explain in two sentences why the sky is blue."


def check_int8(onnx_path: Path, model: Any, tokenizer: Any, greedy_tokens: int = 32) -> dict[str, Any]:
    """Top-1 agreement of the int8 ONNX model at ``onnx_path`` with the PyTorch fp32 model (teacher forcing).

    Two texts: a fixed natural text ("top1_agreement") and the fp32 model's own greedy continuation of a chat
    prompt ("greedy_agreement": how often the int8 draft would propose the target's greedy token, i.e. the
    greedy acceptance rate of a draft identical to the target but for quantization). The PyTorch work runs
    before the ONNX Runtime session exists (ORT's spinning threads would slow PyTorch down on few cores).
    """
    import torch

    cfg = model.config
    num_layers, kv = cfg.num_hidden_layers, kv_shape(cfg)
    ids = _check_ids(tokenizer, cfg.vocab_size, 64)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": _CHECK_PROMPT}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt, dict) or hasattr(prompt, "keys"):
            prompt = prompt["input_ids"]
        prompt = [int(i) for i in prompt]
    else:
        prompt = [int(i) for i in ids[:16]]
    seq = list(prompt)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids)[None]).logits[0].float().numpy()
        # Greedy continuation by the fp32 model (explicit loop: no generation-config surprises).
        out = model(input_ids=torch.tensor([seq]), use_cache=True)
        for _ in range(greedy_tokens):
            seq.append(int(out.logits[0, -1].argmax()))
            cache = out["cache"] if "cache" in out else out["past_key_values"]
            out = model(input_ids=torch.tensor([seq[-1:]]), cache=cache, use_cache=True)
    full = np.asarray(seq, dtype=np.int64)

    sess_q = ort_session(onnx_path)
    half = len(ids) // 2
    a, past = ort_run(sess_q, ids[None, :half], None, num_layers, kv)
    b, _ = ort_run(sess_q, ids[None, half:], past, num_layers, kv)  # also exercises the past path
    q = np.concatenate([a[0], b[0]])
    lq, _ = ort_run(sess_q, full[None], None, num_layers, kv)
    pred = lq[0].argmax(-1)[len(prompt) - 1 : -1]
    return {
        "top1_agreement": float((q.argmax(-1) == ref.argmax(-1)).mean()),
        "num_positions": int(len(ids)),
        "max_abs_diff": float(np.abs(q - ref).max()),
        "mean_abs_diff": float(np.abs(q - ref).mean()),
        "greedy_agreement": float((pred == full[len(prompt) :]).mean()),
        "greedy_tokens": greedy_tokens,
    }


def check_fp32_or_raise(src: Path, fp32_path: Path, model: Any, tokenizer: Any, report: dict[str, Any]) -> None:
    """Record :func:`check_fp32` of the fp32 graph in ``report``; ExportCheckError beyond FP32_TOLERANCE, or
    when ONNX Runtime cannot load or run the graph (one line: the runtime's first)."""
    try:
        res = check_fp32(ort_session(fp32_path), model, tokenizer)
    except Exception as exc:  # noqa: BLE001 - ORT's own error types (InvalidArgument, Fail, ...) share no base
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ExportCheckError(f"ONNX Runtime cannot run the exported graph of {src}: {first}") from exc
    report["fp32_check"] = res
    if not res["max_abs_diff"] <= FP32_TOLERANCE:
        raise ExportCheckError(
            f"ONNX export of {src} is wrong: max |logit diff| vs PyTorch = {res['max_abs_diff']:.3g} "
            f"> {FP32_TOLERANCE} (cases: {res['cases']})"
        )
