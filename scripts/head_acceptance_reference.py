"""Greedy acceptance of a converted draft head, per draft position, two ways side by side: an offline reference
(the target's hidden states of the target-only output from HF, the ONNX head drafting γ tokens from every block
start as the served path would, fresh cache each block) and the served path (HeadDrafter + a real gRPC verifier's
features). Equal per-position numbers mean the features, positions and KV cache line up; a gap means a bug.

    python scripts/head_acceptance_reference.py HEAD_DIR [NUM_PROMPTS] [MAX_NEW_TOKENS]

Prompts: the first turns of specdec/data/spec_bench_dev.jsonl, taken as `specdec bench --limit N` takes them
(round-robin across categories); γ = 4; prints one JSON line per path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

GAMMA = 4


def _features(hf, seq: list[int], layers: list[int]) -> np.ndarray:
    with torch.inference_mode():
        out = hf.model(torch.tensor([seq]), output_hidden_states=True)
    states = list(out.hidden_states[: hf.config.num_hidden_layers]) + [out.last_hidden_state]
    return torch.cat([states[i][0] for i in layers], -1).numpy()


def offline(hf, head, prompt_ids: list[int], gold: list[int]) -> tuple[np.ndarray, int]:
    """(accepted count per draft position, blocks) of greedy drafting from the exact target features."""
    seq = prompt_ids + gold
    fused = head.fuse(_features(hf, seq, [hf.config.num_hidden_layers if i == -1 else i
                                         for i in head.meta["feature_layers"]])[:-1])
    per, blocks, c = np.zeros(GAMMA), 0, len(prompt_ids) + 1  # the prefill commits the first token
    while c < len(seq) - 1:
        head.reset()
        logits, own = head.forward(seq[1:c], fused[: c - 1])
        n = 0
        for i in range(GAMMA):
            token = int(head.full_vocab_logits(logits[-1]).argmax())
            if c + i >= len(seq) or token != seq[c + i]:
                break
            n += 1
            per[i] += 1
            logits, own = head.forward([token], own[-1:])
        blocks += 1
        c += n + 1
    return per, blocks


def main() -> None:
    from transformers import AutoModelForCausalLM

    from specdec.bench.prompts import load_prompts
    from specdec.embedded import EmbeddedServer
    from specdec.models import default_model_paths
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
    from specdec_runtime.edge_client.drafting.head import HeadDrafter
    from specdec_runtime.edge_client.drafting.head_model import OnnxHead
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    head_dir = sys.argv[1]
    num_prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    new_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    target_dir = str(default_model_paths().target_dir)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = OnnxHead(head_dir)
    data = Path(__file__).resolve().parents[1] / "specdec" / "data" / "spec_bench_dev.jsonl"
    prompts = [q.prompt for q in load_prompts(data, limit=num_prompts)]  # bench's pick: round-robin by category
    per, blocks, golds = np.zeros(GAMMA), 0, []
    for prompt in prompts:
        ids = encode_prompt(head.tokenizer, prompt)
        with torch.inference_mode():
            gold = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0].tolist()[len(ids):]
        golds.append(gold)
        p, b = offline(hf, head, ids, gold)
        per, blocks = per + p, blocks + b
    print(json.dumps({"path": "offline", "blocks": blocks, "accepted_per_position": (per / blocks).round(3).tolist()}))
    per, blocks, accepted, drafted, identical = np.zeros(GAMMA), 0, 0, 0, True
    with EmbeddedServer(verifier=Verifier(TargetRunner(target_dir)), grace_s=1.0) as address:
        with EdgeClient(GrpcBackend(address), HeadDrafter(OnnxHead(head_dir)), head.tokenizer,
                        num_speculative_tokens=GAMMA) as client:
            for prompt, gold in zip(prompts, golds):
                got = client.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True)
                identical &= list(got.token_ids[: len(gold)]) == gold
                s = got.stats
                accepted, drafted, blocks = accepted + s.num_accepted_tokens, drafted + s.num_draft_tokens, blocks + s.num_drafts
                per[: len(s.num_accepted_tokens_per_pos)] += s.num_accepted_tokens_per_pos
    print(json.dumps({"path": "served", "blocks": blocks, "accepted_per_position": (per / blocks).round(3).tolist(),
                      "acceptance_rate": round(accepted / max(drafted, 1), 3), "identical": bool(identical)}))


if __name__ == "__main__":
    main()
