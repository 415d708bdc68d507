"""Draft and target vocabularies, end to end: an edge whose tokenizer differs from the target's (another tokenizer
altogether, or the target's with one token more) is refused at OpenSession with FAILED_PRECONDITION before any
prefill; a draft whose logits are padded past the shared tokenizer (embedding rows rounded up) is accepted, its
padding ids never drafted, the greedy output identical to target-only."""

from __future__ import annotations

import grpc
import pytest

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.errors import PreconditionError
from specdec_runtime.common.vocab import VocabMismatchError, check_vocab_compatible
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec.embedded import LocalBackend
from specdec.models import export_onnx_draft

PADDED_VOCAB = 49152 + 64
PROMPT = [1, 504, 3458, 314, 253, 1789, 30]


@pytest.fixture(scope="module")
def runner(tiny_pair):
    return TargetRunner(tiny_pair.target_dir)


@pytest.fixture(scope="module")
def backend(runner):
    backend = LocalBackend(Verifier(runner, max_num_speculative_tokens=8))
    yield backend
    backend.close()


def _word_level_tokenizer():
    """A different tiny tokenizer (word level, 64 words), as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _superset_tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair.target_dir))
    tok.add_tokens(["<draft_only_token>"])
    return tok


@pytest.mark.parametrize("which", ["other_tokenizer", "one_token_more"])
def test_different_tokenizer_refused_before_prefill(tiny_pair, runner, backend, which):
    tokenizer = _word_level_tokenizer() if which == "other_tokenizer" else _superset_tokenizer(tiny_pair)
    client = EdgeClient(backend, None, tokenizer)
    reserved, forwards = runner.kv_reserved_tokens, runner._forwards_since_trim
    with pytest.raises(PreconditionError) as info:
        client.generate([1, 5, 6, 7], max_new_tokens=4)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "fingerprint" in str(info.value)
    assert runner.kv_reserved_tokens == reserved and runner._forwards_since_trim == forwards  # nothing prefilled
    from transformers import AutoTokenizer

    with pytest.raises(VocabMismatchError):  # the CLI's check before any session: the first differing id named
        check_vocab_compatible(tokenizer, AutoTokenizer.from_pretrained(str(tiny_pair.target_dir)), 49152, 49152)


@pytest.fixture(scope="module")
def padded_draft_dir(tiny_pair, tmp_path_factory):
    """A tiny Llama draft with the target's tokenizer and logits padded to 49216 columns, in ONNX fp32."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("padded_draft")
    config = LlamaConfig(vocab_size=PADDED_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # large padding columns: a drafter ignoring valid_vocab_size could draft them
        model.get_output_embeddings().weight[49152:] = 1.0
    model.save_pretrained(root / "hf")
    AutoTokenizer.from_pretrained(str(tiny_pair.target_dir)).save_pretrained(root / "hf")
    return export_onnx_draft(root / "hf", root / "onnx", quantize_int8=False, progress=False, builder="torch")


def test_padded_draft_vocabulary_accepted(tiny_pair, runner, backend, padded_draft_dir):
    model = OnnxDraftModel(padded_draft_dir)
    assert model.vocab_size == PADDED_VOCAB
    valid = check_vocab_compatible(model.tokenizer, runner.tokenizer, model.vocab_size, runner.vocab_size)
    assert valid == 49152
    drafter = ModelDrafter(model, valid_vocab_size=valid)
    spec = EdgeClient(backend, drafter, model.tokenizer, num_speculative_tokens=4)
    res = spec.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    plain = EdgeClient(backend, None, model.tokenizer).generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert res.token_ids == plain.token_ids
    assert res.stats.num_draft_tokens > 0 and max(res.token_ids) < valid
