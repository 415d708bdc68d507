"""Sampled decoding with a draft head over a real gRPC verifier is lossless: the first token's law is the target's
processed distribution (chi-square, fixed seeds, the helpers of test_sampled_lossless.py) and a wrong reference is
rejected (negative control); seeded runs reproduce; drafter-invariant sessions give the same tokens with the head as
with the self-draft. The head's draft vocabulary holds the target's nucleus after the prompt (plus others), so its
top-k q meets p: acceptances and rejections both happen."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from _heads import write_eagle3
from specdec.embedded import EmbeddedServer
from specdec.models.head_export import export_head
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.edge_client.client import EdgeClient
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.head import HeadDrafter
from specdec_runtime.edge_client.drafting.head_model import OnnxHead
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
from test_sampled_lossless import HFReference, chi2_categorical

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [504, 6376, 314]  # "The sky is"
TEMPERATURE, TOP_K, TOP_P = 1.0, 30, 0.8
SESSIONS = 300
KW = dict(max_new_tokens=2, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, ignore_eos=True, chat=False)


@pytest.fixture(scope="module")
def setup(tiny_pair, tmp_path_factory):
    hf = AutoModelForCausalLM.from_pretrained(tiny_pair.target_dir, dtype=torch.float32).eval()
    reference = HFReference(hf, TEMPERATURE, TOP_K, TOP_P)
    nucleus = [int(t) for t in reference(PROMPT).ids]
    vocab = sorted(set(nucleus) | set(range(0, 49152, 4099)))  # the nucleus + others: rejections too
    root = tmp_path_factory.mktemp("sampled-head")
    head_dir = export_head(tiny_pair.target_dir, write_eagle3(root / "ckpt", tiny_pair.target_dir, vocab, seed=3),
                           root / "head")
    return hf, reference, head_dir


def _head_client(address, head_dir):
    head = OnnxHead(head_dir)
    return EdgeClient(GrpcBackend(address), HeadDrafter(head, draft_top_k=4), head.tokenizer,
                      num_speculative_tokens=2, timeout_s=60.0)


def test_head_sampling_is_lossless_reproducible_and_drafter_invariant(setup, tiny_pair):
    hf, reference, head_dir = setup
    runner = TargetRunner(tiny_pair.target_dir)
    first, accepted, drafted = [], 0, 0
    with EmbeddedServer(verifier=Verifier(runner, max_num_speculative_tokens=2, max_batch_wait_ms=0.0),
                        grace_s=1.0) as address:
        with _head_client(address, head_dir) as client:
            for seed in range(SESSIONS):
                res = client.generate(PROMPT, seed=seed, **KW)
                first.append(res.token_ids[0])
                accepted += res.stats.num_accepted_tokens
                drafted += res.stats.num_draft_tokens
            again = [client.generate(PROMPT, seed=seed, **KW).token_ids for seed in range(5)]
            invariant_head = [client.generate(PROMPT, seed=seed, drafter_invariant=True, **KW).token_ids
                              for seed in range(8)]
        draft = OnnxDraftModel(tiny_pair.draft_dir)
        with EdgeClient(GrpcBackend(address), ModelDrafter(draft, draft_top_k=4), draft.tokenizer,
                        num_speculative_tokens=2) as client:
            invariant_self = [client.generate(PROMPT, seed=seed, drafter_invariant=True, **KW).token_ids
                              for seed in range(8)]
    first = np.array(first)
    assert 0 < accepted < drafted  # the head's q meets p: acceptance and rejection both happen
    p1 = reference(PROMPT)
    c = chi2_categorical(first, p1)
    print(f"\nhead, first token: chi2 {c.stat:.1f} (df {c.df}, critical {c.critical:.1f}); "
          f"acceptance {accepted}/{drafted}")
    assert not c.rejected, c
    wrong = HFReference(hf, TEMPERATURE, TOP_K, 1.0)(PROMPT)  # negative control: the target without top-p
    assert chi2_categorical(first, wrong).rejected
    assert [t[0] for t in again] == [int(t) for t in first[:5]]  # seeded runs reproduce
    assert invariant_head == invariant_self
