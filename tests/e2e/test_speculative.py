"""End-to-end speculative decoding (in-process verifier): exactness against target-only decoding, stopping
cases, seeded sampling, bad input. Tiny models from conftest (CI-sized) plus one test on the real pair."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.errors import InvalidRequestError
from specdec_runtime.common.paths import ModelNotFoundError
from _reference import hf_greedy  # noqa: E402
from specdec_runtime.common.types import DraftBlock, FinishReason
from specdec.embedded import LocalBackend
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

PROMPTS = [
    "Why is the sky blue?",
    "Write a limerick about a cat.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def tiny_verifier(tiny_pair):
    runner = TargetRunner(tiny_pair.target_dir)
    backend = LocalBackend(Verifier(runner, max_num_speculative_tokens=8))
    yield backend
    backend.close()


def make_client(backend, draft_dir, gamma=4, **kw):
    model = OnnxDraftModel(draft_dir)
    return EdgeClient(backend, ModelDrafter(model, **kw), model.tokenizer, num_speculative_tokens=gamma)


def target_only_client(backend, draft_dir):
    model = OnnxDraftModel(draft_dir)
    return EdgeClient(backend, None, model.tokenizer)


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("which", ["draft_dir", "other_draft_dir"])
def test_greedy_token_identical_to_hf_target_only(tiny_pair, tiny_verifier, gamma, which):
    client = make_client(tiny_verifier, getattr(tiny_pair, which), gamma)
    for prompt in PROMPTS:
        ids = encode_prompt(client.tokenizer, prompt)
        ref = hf_greedy(tiny_pair.target_dir, ids, 24)
        res = client.generate(ids, max_new_tokens=24, ignore_eos=True)
        assert res.token_ids == ref
        assert res.stats.num_generated_tokens == 24
        if which == "draft_dir":  # the draft IS the target (in ONNX): nearly everything is accepted
            assert res.stats.acceptance_rate > 0.8
        else:
            assert res.stats.acceptance_rate < 0.5


def test_target_only_mode_matches_hf(tiny_pair, tiny_verifier):
    client = target_only_client(tiny_verifier, tiny_pair.draft_dir)
    ids = encode_prompt(client.tokenizer, PROMPTS[0])
    res = client.generate(ids, max_new_tokens=16, ignore_eos=True)
    assert res.token_ids == hf_greedy(tiny_pair.target_dir, ids, 16)
    assert res.stats.num_drafts == 16 and res.stats.num_draft_tokens == 0
    out = res.to_json()
    assert out["acceptance_rate"] is None and out["mean_accepted_length"] == 1.0  # nothing drafted: null, not 0


def _reference(tiny_pair, client, n=16):
    ids = encode_prompt(client.tokenizer, PROMPTS[1])
    return ids, hf_greedy(tiny_pair.target_dir, ids, n)


def test_stop_token_in_the_middle_of_an_accepted_block(tiny_pair, tiny_verifier):
    client = make_client(tiny_verifier, tiny_pair.draft_dir, gamma=5)
    ids, ref = _reference(tiny_pair, client)
    # a token first appearing at index >= 2 of the reference: it falls inside a block
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    res = client.generate(ids, max_new_tokens=16, stop_token_ids=[ref[k]], ignore_eos=True)
    assert res.token_ids == ref[: k + 1]
    assert res.finish_reason == FinishReason.EOS


def test_stop_string_spanning_two_tokens(tiny_pair, tiny_verifier):
    client = make_client(tiny_verifier, tiny_pair.draft_dir, gamma=4)
    tok = client.tokenizer
    ids, ref = _reference(tiny_pair, client)
    texts = [tok.decode(ref[: i + 1]) for i in range(len(ref))]
    # pick i such that the tail of token i and the head of token i+1 form a fresh stop string
    for i in range(3, len(ref) - 1):
        a, b = texts[i][len(texts[i - 1]):], texts[i + 1][len(texts[i]):]
        if len(a) >= 1 and len(b) >= 1:
            stop = a[-1:] + b[:1]
            if stop not in texts[i]:
                break
    else:
        pytest.skip("no suitable token pair")
    deltas = list(client.stream(ids, max_new_tokens=16, stop=[stop], ignore_eos=True))
    res = client.last_result
    assert res.finish_reason == FinishReason.STOP_STRING
    assert res.token_ids == ref[: i + 2]
    assert stop not in res.text and res.text == texts[i + 1][: texts[i + 1].index(stop)]
    assert "".join(deltas) == res.text  # nothing after the stop was streamed


@pytest.mark.parametrize("max_new_tokens", [1, 2])
def test_max_new_tokens_smaller_than_the_block(tiny_pair, tiny_verifier, max_new_tokens):
    client = make_client(tiny_verifier, tiny_pair.draft_dir, gamma=4)
    ids, ref = _reference(tiny_pair, client)
    res = client.generate(ids, max_new_tokens=max_new_tokens, ignore_eos=True)
    assert res.token_ids == ref[:max_new_tokens]
    assert res.finish_reason == FinishReason.LENGTH


class EosDrafter:
    """Always proposes EOS first: the target must reject it (unless EOS is its argmax)."""

    def __init__(self, eos):
        self.eos = eos

    def propose(self, committed, gamma, sampling, min_confidence=0.0):
        return DraftBlock([self.eos] * gamma)


def test_draft_proposing_eos_rejected_by_target(tiny_pair, tiny_verifier):
    client = make_client(tiny_verifier, tiny_pair.draft_dir)
    ids, ref = _reference(tiny_pair, client)
    eos = client.tokenizer.eos_token_id
    assert eos not in ref
    client.drafter = EosDrafter(eos)
    res = client.generate(ids, max_new_tokens=16)
    assert res.token_ids == ref
    assert res.finish_reason == FinishReason.LENGTH
    assert res.stats.num_accepted_tokens == 0


def test_prompt_at_the_context_limit(tiny_pair, tiny_verifier):
    client = make_client(tiny_verifier, tiny_pair.draft_dir)
    max_ctx = 512  # tiny model's max_position_embeddings
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 1000, size=max_ctx - 1).tolist()
    res = client.generate(ids, max_new_tokens=8, ignore_eos=True)
    assert len(res.token_ids) == 1 and res.finish_reason == FinishReason.CONTEXT
    assert res.token_ids == hf_greedy(tiny_pair.target_dir, ids, 1)
    with pytest.raises(InvalidRequestError, match="no room in the context"):
        client.generate(rng.integers(3, 1000, size=max_ctx).tolist(), max_new_tokens=8)
    # the context limit inside a block: 3 tokens of room, gamma 4
    ids = ids[: max_ctx - 3]
    res = client.generate(ids, max_new_tokens=8, ignore_eos=True)
    assert len(res.token_ids) == 3 and res.finish_reason == FinishReason.CONTEXT


def test_seeded_sampling_is_reproducible(tiny_pair, tiny_verifier):
    client = make_client(tiny_verifier, tiny_pair.other_draft_dir, gamma=3, draft_top_k=4)
    ids = encode_prompt(client.tokenizer, PROMPTS[2])
    a = client.generate(ids, max_new_tokens=20, temperature=1.0, seed=7, ignore_eos=True).token_ids
    b = client.generate(ids, max_new_tokens=20, temperature=1.0, seed=7, ignore_eos=True).token_ids
    c = client.generate(ids, max_new_tokens=20, temperature=1.0, seed=8, ignore_eos=True).token_ids
    assert a == b
    assert a != c


def test_bad_input_errors(tiny_pair, tiny_verifier, tmp_path):
    client = make_client(tiny_verifier, tiny_pair.draft_dir)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        client.generate("   ")
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        EdgeClient(tiny_verifier, None, client.tokenizer, num_speculative_tokens=0)
    with pytest.raises(ModelNotFoundError):
        TargetRunner(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError):
        OnnxDraftModel(tmp_path / "nope")


def test_cli_one_line_errors(tiny_pair, tmp_path):
    from typer.testing import CliRunner

    from specdec.cli import app

    runner = CliRunner()
    cases = [
        (["generate", ""], "empty prompt"),
        (["generate", "hi", "--target", str(tmp_path / "missing"), "--draft", str(tiny_pair.draft_dir)], "missing"),
        (["generate", "hi", "-g", "0", "--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir)],
         "num-speculative-tokens"),
    ]
    for args, needle in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        err = result.stderr.strip()
        assert err.startswith("error:") and needle in err and "\n" not in err, err


def test_cli_mismatched_vocabularies(tiny_pair, tmp_path):
    """A draft whose tokenizer differs from the target's is refused with a one-line error."""
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from specdec.cli import app

    import shutil

    bad = tmp_path / "bad-draft"
    shutil.copytree(tiny_pair.draft_dir, bad)
    tok_json = json.loads((bad / "tokenizer.json").read_text())
    vocab = tok_json["model"]["vocab"]
    swap = [k for k, v in vocab.items() if v in (100, 101)]
    vocab[swap[0]], vocab[swap[1]] = vocab[swap[1]], vocab[swap[0]]
    (bad / "tokenizer.json").write_text(json.dumps(tok_json))
    AutoTokenizer.from_pretrained(bad)  # still a valid tokenizer
    result = CliRunner().invoke(
        app, ["generate", "hi", "--in-process", "--target", str(tiny_pair.target_dir), "--draft", str(bad)]
    )
    assert result.exit_code == 2
    assert "vocab" in result.stderr.lower() and "\n" not in result.stderr.strip()


@pytest.mark.real_model
def test_real_pair_greedy_identical_to_target_only(real_pair):
    """SmolLM2-135M target (fp32) with its ONNX int8 draft: token-identical to HF greedy decoding."""

    runner = TargetRunner(real_pair.target_dir)
    backend = LocalBackend(Verifier(runner))
    try:
        client = make_client(backend, real_pair.draft_dir, gamma=4)
        from specdec.cli import DEFAULT_PROMPTS

        lines = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines()[:40:13]]
        prompts = [q["turns"][0] for q in lines]
        for prompt in prompts[:3]:
            ids = encode_prompt(client.tokenizer, prompt)
            ref = hf_greedy(real_pair.target_dir, ids, 32)
            res = client.generate(ids, max_new_tokens=32, ignore_eos=True)
            assert res.token_ids == ref
            assert res.stats.acceptance_rate > 0.5
    finally:
        backend.close()
