"""Concurrent greedy speculative sessions, twins with identical prompts among them, over a real gRPC verifier:
each token-identical to target-only decoding (plain HF generate) of its prompt.

Every session has its own thread, client, channel and draft, and all share ONE HF tokenizer and pass text
prompts, as a benchmark or an application serving several users does. Sessions with identical prompts share
prompt KV pages through the prefix cache and their blocks share forward passes, so this also covers page sharing
and batching. The tokenizer used to switch special-token parsing on its shared Rust backend per call
(common/chat.py, "Thread safety"): a session could get its chat template's markers as plain text, another
prompt, and output that differed from target-only decoding of the prompt meant (here 2-3 of 36 sessions per run
without the fix). Marked slow: about 10 s (the tiny pair's build is the session fixture's).
"""

from __future__ import annotations

import threading

import pytest
from transformers import AutoTokenizer

from _reference import hf_greedy  # noqa: E402
from specdec.embedded import EmbeddedServer
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

PROMPTS = ["Explain how a rainbow forms.", "Write a short poem about the sea.", "List three uses of a paperclip.",
           "Give me a recipe for pancakes.", "What is speculative decoding?", "How do airplanes stay in the air?"]
SESSIONS = PROMPTS * 2  # twins: the same prompt twice, at the same time
NEW_TOKENS = 16
ROUNDS = 3  # bursts of all sessions at once (the race needed threads tokenizing together: more tries)


@pytest.mark.slow
def test_concurrent_sessions_with_twins_token_identical_to_hf_greedy(tiny_pair):
    tok = AutoTokenizer.from_pretrained(str(tiny_pair.target_dir))  # one tokenizer for every thread
    prompt_ids = {p: encode_prompt(tok, p) for p in PROMPTS}  # a lone thread's ids: the prompts meant
    ref = {p: hf_greedy(tiny_pair.target_dir, ids, NEW_TOKENS) for p, ids in prompt_ids.items()}
    verifier = Verifier(TargetRunner(tiny_pair.target_dir), max_num_speculative_tokens=8, cost_table_dir=False)
    drafters = [ModelDrafter(OnnxDraftModel(tiny_pair.draft_dir, intra_op_num_threads=1)) for _ in SESSIONS]
    out: dict[tuple[int, int], tuple] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(SESSIONS))

    def session(r: int, i: int, address: str) -> None:
        try:
            with EdgeClient(GrpcBackend(address), drafters[i], tok, num_speculative_tokens=4) as client:
                start.wait(timeout=60)  # every session tokenizes its prompt at once
                res = client.generate(SESSIONS[i], max_new_tokens=NEW_TOKENS, ignore_eos=True)
                out[r, i] = (res.prompt_token_ids, res.token_ids)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with EmbeddedServer(verifier=verifier) as address:
        for r in range(ROUNDS):
            threads = [threading.Thread(target=session, args=(r, i, address)) for i in range(len(SESSIONS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
    assert not errors, errors[0]
    assert len(out) == ROUNDS * len(SESSIONS)
    wrong_output = [k for k, (_, ids) in sorted(out.items()) if list(ids) != ref[SESSIONS[k[1]]]]
    wrong_prompt = [k for k, (ids, _) in sorted(out.items()) if list(ids) != prompt_ids[SESSIONS[k[1]]]]
    assert not wrong_output, (f"(round, session) {wrong_output} differ from target-only decoding; "
                              f"{wrong_prompt} got other prompt ids than a lone thread's")
    assert not wrong_prompt, f"(round, session) {wrong_prompt} got other prompt ids than a lone thread's"
