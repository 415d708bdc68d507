"""Time to first token of a conversation's later turns: a kept session (ExtendSession, both KV caches kept)
against a fresh session over the same history (the verifier and the draft prefill all of it).

Default models, embedded verifier (a real gRPC server on 127.0.0.1, as ``specdec generate`` without
``--server``), greedy. One conversation of ``--turns`` turns; at the turns listed in ``--at`` the same turn is
also run as a fresh session (new session, draft KV cache reset) over the same prompt ids, and both outputs are
checked to be token-identical. Prints JSON.

    python -m specdec.bench.multiturn [--turns 8] [--at 2,8] [--max-new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

USER_TURNS = [
    "Explain what speculative decoding is, in a few sentences.",
    "Why does the draft model need to share the target's vocabulary?",
    "What happens when the verifier rejects a draft token?",
    "How does batching many sessions help the cloud verifier?",
    "What is the acceptance rate and how is it measured?",
    "Give me one practical tip to make the draft model better.",
    "How would you run this on a phone?",
    "Summarize our conversation in two sentences.",
    "Thanks! Any last advice?",
    "Goodbye.",
]


def _ttft(chunks) -> tuple[float, list[str]]:
    """Seconds from the call to the first text chunk; drains the stream."""
    t0 = time.perf_counter()
    first = None
    texts = []
    for c in chunks:
        if first is None and c.text:
            first = time.perf_counter() - t0
        texts.append(c.text)
    return (first if first is not None else time.perf_counter() - t0), texts


def run(turns: int, at: list[int], max_new_tokens: int, repeats: int, gamma: int) -> dict:
    from specdec_runtime.cloud_verifier.config import VerifierSettings
    from specdec_runtime.common.paths import default_model_paths
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import EmbeddedServer

    paths = default_model_paths()
    opts = dict(max_new_tokens=max_new_tokens)
    results = {}
    with EmbeddedServer(settings=VerifierSettings(metrics_port=0)) as address:
        backend = GrpcBackend(address)

        def client() -> EdgeClient:
            model = OnnxDraftModel(paths.draft_dir)
            return EdgeClient(backend, ModelDrafter(model), model.tokenizer, num_speculative_tokens=gamma)

        conv_client, fresh_client = client(), client()
        list(fresh_client.stream_chunks("Hello", max_new_tokens=4))  # warm-up (first forward passes)
        kept: dict[int, list[float]] = {k: [] for k in at}
        fresh: dict[int, list[float]] = {k: [] for k in at}
        history_tokens: dict[int, int] = {}
        identical: dict[int, bool] = {}
        for _ in range(repeats):
            with conv_client.chat(**opts) as conv:
                for turn in range(1, turns + 1):
                    s, _ = _ttft(conv.send(USER_TURNS[(turn - 1) % len(USER_TURNS)]))
                    if turn not in kept:
                        continue
                    r = conv.last_result
                    kept[turn].append(s)
                    history_tokens[turn] = len(r.prompt_token_ids)
                    fresh_client.drafter.reset()  # a fresh session's draft has no KV cache either
                    f, _ = _ttft(fresh_client.stream_chunks(r.prompt_token_ids, **opts))
                    fresh[turn].append(f)
                    identical[turn] = identical.get(turn, True) and (
                        fresh_client.last_result.token_ids == r.token_ids)
                    assert r.num_reopened_sessions == 0 and r.num_sessions == 1
        backend.close()
    for turn in at:
        k, f = statistics.median(kept[turn]), statistics.median(fresh[turn])
        results[f"turn_{turn}"] = {
            "prompt_tokens": history_tokens[turn],
            "ttft_kept_session_ms": round(1000 * k, 1),
            "ttft_fresh_session_ms": round(1000 * f, 1),
            "speedup": round(f / k, 2) if k else None,
            "ttft_kept_all_ms": [round(1000 * x, 1) for x in kept[turn]],
            "ttft_fresh_all_ms": [round(1000 * x, 1) for x in fresh[turn]],
            "outputs_identical": identical[turn],
        }
    return {"models": {"target": str(paths.target_dir), "draft": str(paths.draft_dir)},
            "verifier": "embedded (gRPC on 127.0.0.1)", "max_new_tokens": max_new_tokens,
            "num_speculative_tokens": gamma, "repeats": repeats, "turns": results}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--at", default="2,8", help="turns measured against a fresh session (comma-separated)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="conversations run (medians reported)")
    ap.add_argument("--gamma", type=int, default=4, help="num_speculative_tokens")
    a = ap.parse_args(argv)
    at = sorted({int(x) for x in a.at.split(",") if x.strip()})
    if not at or min(at) < 2 or max(at) > a.turns:
        ap.error("--at turns must be in [2, --turns]")
    print(json.dumps(run(a.turns, at, a.max_new_tokens, a.repeats, a.gamma), indent=2))


if __name__ == "__main__":
    main()
