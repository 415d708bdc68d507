"""A draft whose context is shorter than the target's: past the draft's window the session goes on with blocks of
0 draft tokens (the target decoding alone), never an error, the output identical to target-only decoding and
ending at the target's context limit exactly."""

from __future__ import annotations

import json

import pytest

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.types import FinishReason
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import LocalBackend
from specdec.models import export_onnx_draft

DRAFT_CONTEXT = 256
TARGET_CONTEXT = 512  # tiny_pair's target


@pytest.fixture(scope="module")
def short_draft_dir(tiny_pair, tmp_path_factory):
    """The tiny target's own weights as an ONNX draft with a 256-token context (config and graph)."""
    root = tmp_path_factory.mktemp("short_draft")
    hf_dir = root / "hf"
    hf_dir.mkdir()
    for f in tiny_pair.target_dir.iterdir():
        (hf_dir / f.name).symlink_to(f)
    (hf_dir / "config.json").unlink()
    config = json.loads((tiny_pair.target_dir / "config.json").read_text())
    assert config["max_position_embeddings"] == TARGET_CONTEXT
    config["max_position_embeddings"] = DRAFT_CONTEXT
    (hf_dir / "config.json").write_text(json.dumps(config))
    return export_onnx_draft(hf_dir, root / "onnx", quantize_int8=False, progress=False, builder="torch")


@pytest.fixture(scope="module")
def backend(tiny_pair):
    backend = LocalBackend(Verifier(TargetRunner(tiny_pair.target_dir), max_num_speculative_tokens=8))
    yield backend
    backend.close()


def test_room_counts_the_draft_tokens_that_fit(short_draft_dir):
    drafter = ModelDrafter(OnnxDraftModel(short_draft_dir))
    assert drafter.room(DRAFT_CONTEXT - 3) == 4  # committed + 3 draft tokens fed = 256 positions
    assert drafter.room(DRAFT_CONTEXT + 1) == 0
    assert drafter.room(DRAFT_CONTEXT + 200) == 0


def test_generation_past_the_draft_window_to_the_target_limit(backend, short_draft_dir):
    model = OnnxDraftModel(short_draft_dir)
    assert model.max_position_embeddings == DRAFT_CONTEXT
    prompt = [1] + [(7 * i + 3) % 40000 + 5 for i in range(99)]  # 100 tokens
    spec = EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=4)
    res = spec.generate(prompt, max_new_tokens=1000, ignore_eos=True)
    plain = EdgeClient(backend, None, model.tokenizer).generate(prompt, max_new_tokens=1000, ignore_eos=True)
    assert res.token_ids == plain.token_ids
    assert len(prompt) + len(res.token_ids) == TARGET_CONTEXT
    assert res.finish_reason == plain.finish_reason == FinishReason.CONTEXT
    assert model.num_cached <= DRAFT_CONTEXT
    # it drafted until the window (blocks of 4 accepted + 1 bonus token), then stopped drafting
    assert 0.7 * (DRAFT_CONTEXT - len(prompt)) <= res.stats.num_draft_tokens <= DRAFT_CONTEXT - len(prompt)
