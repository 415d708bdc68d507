"""The draft's prefix cache measured: ``python -m specdec.bench.draft_prefix [--system-tokens 500] [--runs 8]``.

One client, ``runs`` consecutive new sessions whose prompts share a ``system_tokens``-token system prompt (then a
short user message of their own). The draft first warms up on an unrelated prompt; before each session its KV
cache is emptied (a new session on a draft that served another context meanwhile), so each prefill either
restores the shared prefix from the prefix cache (edge_client.drafting.prefix_cache) or pays it whole. Per session:
the draft's prefill time (ModelDrafter.prefill_step to the end of the prompt, the path the first block takes),
then a greedy speculative generation checked token-for-token against target-only decoding (the same verifier, no
drafter). Prints one JSON object: ``prefill_s`` per session, ``later_vs_first`` (each of sessions 2.. / the
first), ``identical``. Default models; an embedded verifier (gRPC on 127.0.0.1)."""

from __future__ import annotations

import argparse
import json
import time

__all__ = ["run_draft_prefix_bench"]

_USER = ["What is the capital of France?", "Name three prime numbers.", "Why is the sky blue?",
         "Translate 'good morning' to Spanish.", "How many legs has a spider?", "What does a compiler do?",
         "Give me a synonym of 'quick'.", "What is 12 times 12?"]


def _system_text(tokenizer, n_tokens: int) -> str:
    """A system prompt of about ``n_tokens`` tokens (app rules repeated with numbers: no two lines alike)."""
    lines, i = [], 0
    while len(tokenizer.encode(" ".join(lines))) < n_tokens:
        i += 1
        lines.append(f"Rule {i}: answer politely, cite rule {i} when asked, and keep answers short.")
    return " ".join(lines)


def run_draft_prefix_bench(system_tokens: int = 500, runs: int = 8, max_new_tokens: int = 16,
                           prefix_cache_mb: float = 64.0) -> dict:
    """The measurement of the module docstring, as a JSON-able dict."""
    from specdec_runtime.common.chat import render_chat_ids
    from specdec_runtime.common.paths import default_model_paths
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.cli.pipeline import embedded_backend

    paths = default_model_paths()
    model = OnnxDraftModel(paths.draft_dir)
    drafter = ModelDrafter(model, prefix_cache_mb=prefix_cache_mb)
    system = _system_text(model.tokenizer, system_tokens)
    prompts = [render_chat_ids(model.tokenizer, [{"role": "system", "content": system},
                                                 {"role": "user", "content": _USER[i % len(_USER)]}],
                               add_generation_prompt=True) for i in range(runs)]
    cleanup: list = []
    try:
        backend, _, _ = embedded_backend(paths.target_dir, model, in_process=False, device="cpu", dtype="float32",
                                          cleanup=cleanup)
        assert isinstance(backend, GrpcBackend)
        client = EdgeClient(backend, drafter, model.tokenizer, num_speculative_tokens=4)
        target_only = EdgeClient(backend, None, model.tokenizer)
        warm = render_chat_ids(model.tokenizer, [{"role": "user", "content": _system_text(model.tokenizer, 500)[::-1]}])
        while drafter.prefill_step(warm):  # untimed: the draft's first forward passes of the process are slower
            pass
        drafter.reset()
        if drafter.prefix_cache is not None:
            drafter.prefix_cache.clear()
        prefill_s, identical = [], True
        for ids in prompts:
            drafter.reset()
            t0 = time.perf_counter()
            while drafter.prefill_step(ids):
                pass
            prefill_s.append(time.perf_counter() - t0)
            out = client.generate(ids, max_new_tokens=max_new_tokens, ignore_eos=True).token_ids
            identical &= out == target_only.generate(ids, max_new_tokens=max_new_tokens, ignore_eos=True).token_ids
        backend.close()
    finally:
        for stop in reversed(cleanup):
            stop()
    return {"system_tokens": len(model.tokenizer.encode(system)), "prompt_tokens": [len(p) for p in prompts],
            "prefill_s": [round(t, 4) for t in prefill_s],
            "later_vs_first": [round(t / prefill_s[0], 3) for t in prefill_s[1:]],
            "max_later_vs_first": round(max(prefill_s[1:]) / prefill_s[0], 3) if runs > 1 else None,
            "prefix_cache": {"hits": drafter.prefix_cache.hits if drafter.prefix_cache else 0,
                             "mb": round((drafter.prefix_cache.nbytes if drafter.prefix_cache else 0) / 2**20, 1)},
            "identical": identical}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--prefix-cache-mb", type=float, default=64.0)
    a = ap.parse_args()
    print(json.dumps(run_draft_prefix_bench(a.system_tokens, a.runs, a.max_new_tokens, a.prefix_cache_mb)))


if __name__ == "__main__":
    main()
