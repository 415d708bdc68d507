"""The recording the replay sends: a real edge client's blocks and verdicts per prompt, cached on disk under a key
of everything that determines them (prompts, models, device, dtype, γ, max_new_tokens, format)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._shared import progress_bar
from ..prompts import BenchPrompt

REPLAY_FORMAT = 2  # bump when the recording's content or meaning changes (invalidates the cache)


@dataclass
class RecordedStep:
    """One block an edge client sent and the verdict it got."""

    seq: int
    committed_length: int  # tokens the block extends
    draft_token_ids: list[int]
    num_accepted: int
    next_token_id: int
    verdict_committed_length: int
    finished: bool
    draft_confidence: list[float] | None = None  # [γ] the draft's probability of each drafted token

    def expected(self) -> tuple[int, int, int, bool]:
        return self.num_accepted, self.next_token_id, self.verdict_committed_length, self.finished


@dataclass
class RecordedPrompt:
    question_id: Any
    category: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    steps: list[RecordedStep]

    def committed_before(self, index: int) -> list[int]:
        """Prompt + output tokens committed before step ``index``."""
        cl = self.steps[index].committed_length
        return (self.prompt_token_ids + self.output_token_ids)[:cl]


@dataclass
class Recording:
    key: str
    path: Path
    cached: bool  # loaded from the cache (not recorded in this run)
    max_new_tokens: int
    num_speculative_tokens: int
    tokenizer_fingerprint: str
    prompts: list[RecordedPrompt]
    record_s: float = 0.0

    @property
    def num_steps(self) -> int:
        return sum(len(p.steps) for p in self.prompts)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _model_fingerprint(directory: Path) -> dict:
    """Name, config hash and (size, mtime) of the weight files: changes when the model is re-prepared."""
    d = Path(directory)
    out: dict[str, Any] = {"name": d.name}
    cfg = d / "config.json"
    if cfg.is_file():
        out["config_sha256"] = _file_digest(cfg)[:16]
    for f in sorted(d.iterdir()) if d.is_dir() else []:
        if f.suffix in (".safetensors", ".onnx", ".data", ".bin") or f.name.endswith(".onnx.data"):
            st = f.stat()
            out[f.name] = [st.st_size, st.st_mtime_ns]
    return out


def recording_key(prompts: Path, limit: int, target_dir: Path, draft_dir: Path, *, num_speculative_tokens: int,
                  max_new_tokens: int, device: str, dtype: str) -> str:
    """The cache key of a recording (hex): prompts file hash, limit, model fingerprints, device, dtype, γ,
    max_new_tokens and the recording format."""
    material = {
        "format": REPLAY_FORMAT,
        "prompts_sha256": _file_digest(Path(prompts).expanduser()),
        "limit": limit,
        "target": _model_fingerprint(target_dir),
        "draft": _model_fingerprint(draft_dir),
        "num_speculative_tokens": num_speculative_tokens,
        "max_new_tokens": max_new_tokens,
        "device": device,
        "dtype": dtype,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]


def _replay_cache_dir(cache_dir: Path | None) -> Path:
    from specdec_runtime.common.paths import default_cache_dir

    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir() / "replay"


class _RecordingBackend:
    """Wraps the in-process backend: records every block sent and the verdict it got, in order."""

    def __init__(self, inner):
        self.inner = inner
        self.steps: list[RecordedStep] = []

    def open_session(self, *args, **kwargs):
        return self.inner.open_session(*args, **kwargs)

    def submit(self, session_id, seq, committed_length, block):
        fut = self.inner.submit(session_id, seq, committed_length, block)
        v = fut.result()  # the client waits for it anyway (no proactive drafting): keeps the order
        self.steps.append(RecordedStep(int(seq), int(committed_length), [int(t) for t in block.draft_token_ids],
                                       int(v.num_accepted), int(v.next_token_id), int(v.committed_length),
                                       bool(v.finished), block.draft_confidence))
        return fut

    def close_session(self, session_id):
        return self.inner.close_session(session_id)

    def close(self):
        return self.inner.close()

    def take(self) -> list[RecordedStep]:
        out, self.steps = self.steps, []
        return out


def record_blocks(runner, draft_dir: Path, questions: list[BenchPrompt], *, max_new_tokens: int,
                  num_speculative_tokens: int, progress: bool = False) -> tuple[str, list[RecordedPrompt]]:
    """Run a real edge client (ONNX draft, greedy, fixed γ) on every question against an in-process verifier
    over ``runner``; returns (tokenizer fingerprint, recorded prompts)."""
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.common.vocab import check_vocab_compatible, tokenizer_fingerprint
    from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import LocalBackend

    model = OnnxDraftModel(draft_dir)
    valid = check_vocab_compatible(model.tokenizer, runner.tokenizer, model.vocab_size, runner.vocab_size)
    backend = _RecordingBackend(LocalBackend(Verifier(runner, verify_policy="fixed")))  # whole blocks recorded
    client = EdgeClient(backend, ModelDrafter(model, valid_vocab_size=valid), model.tokenizer,
                        num_speculative_tokens=num_speculative_tokens)  # fixed γ, no truncation, not proactive
    out: list[RecordedPrompt] = []
    bar = progress_bar(progress, len(questions), "recording blocks", "prompt")
    try:
        for q in questions:
            ids = encode_prompt(model.tokenizer, q.prompt, chat=True)
            res = client.generate(ids, max_new_tokens=max_new_tokens, temperature=0.0)
            out.append(RecordedPrompt(q.question_id, q.category, list(ids), list(res.token_ids), backend.take()))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        backend.close()
    return tokenizer_fingerprint(model.tokenizer), out


def _save_recording(path: Path, rec: Recording, config: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "format": REPLAY_FORMAT, "key": rec.key, "config": config, "max_new_tokens": rec.max_new_tokens,
        "num_speculative_tokens": rec.num_speculative_tokens, "tokenizer_fingerprint": rec.tokenizer_fingerprint,
        "record_s": rec.record_s,
        "prompts": [
            {"question_id": p.question_id, "category": p.category, "prompt_token_ids": p.prompt_token_ids,
             "output_token_ids": p.output_token_ids,
             "steps": [[s.seq, s.committed_length, s.draft_token_ids, s.num_accepted, s.next_token_id,
                        s.verdict_committed_length, int(s.finished), s.draft_confidence] for s in p.steps]}
            for p in rec.prompts
        ],
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, separators=(",", ":")))
    os.replace(tmp, path)  # atomic: a concurrent run sees the old file or the whole new one


def _load_recording(path: Path, key: str) -> Recording | None:
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if body.get("format") != REPLAY_FORMAT or body.get("key") != key:
        return None
    prompts = [
        RecordedPrompt(p["question_id"], p["category"], p["prompt_token_ids"], p["output_token_ids"],
                       [RecordedStep(s[0], s[1], s[2], s[3], s[4], s[5], bool(s[6]), s[7]) for s in p["steps"]])
        for p in body["prompts"]
    ]
    return Recording(key, path, True, body["max_new_tokens"], body["num_speculative_tokens"],
                     body["tokenizer_fingerprint"], prompts, float(body.get("record_s", 0.0)))


def load_or_record(prompts: Path, questions: list[BenchPrompt], limit: int, target_dir: Path, draft_dir: Path,
                   runner_factory, *, max_new_tokens: int, num_speculative_tokens: int, device: str, dtype: str,
                   cache_dir: Path | None = None, progress: bool = False) -> Recording:
    """The cached recording for these inputs, or a new one (recorded with ``runner_factory()``'s runner, then
    cached)."""
    key = recording_key(prompts, limit, target_dir, draft_dir, num_speculative_tokens=num_speculative_tokens,
                        max_new_tokens=max_new_tokens, device=device, dtype=dtype)
    path = _replay_cache_dir(cache_dir) / f"blocks-{key}.json"
    rec = _load_recording(path, key)
    if rec is not None:
        return rec
    t = time.perf_counter()
    fingerprint, recorded = record_blocks(runner_factory(), draft_dir, questions, max_new_tokens=max_new_tokens,
                                          num_speculative_tokens=num_speculative_tokens, progress=progress)
    rec = Recording(key, path, False, max_new_tokens, num_speculative_tokens, fingerprint, recorded,
                    time.perf_counter() - t)
    config = {"prompts": str(Path(prompts).expanduser()), "limit": limit, "target": str(target_dir),
              "draft": str(draft_dir), "device": device, "dtype": dtype}
    _save_recording(path, rec, config)
    return rec
