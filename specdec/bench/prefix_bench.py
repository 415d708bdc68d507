"""Automatic prefix caching with the real target: sixteen sessions opening with the same long system prompt.

Opens ``--sessions`` sessions one after the other, each with the same ``--prefix-tokens``-token system prompt and
a different question, on an in-process verifier over the target (default: the prepared model, ``specdec models
prepare``), once with prefix caching and once without. Reports the open time of session 1 and of sessions
2..N (median, and the ratio to session 1), the prompt tokens actually prefilled, and the KV pages in use once
all are open; then decodes every session greedily (empty draft blocks: target-only) and checks that the outputs
with and without caching are token-identical. Prints one JSON object.

    python -m specdec.bench.prefix_bench [--sessions 16] [--prefix-tokens 500] [--max-new-tokens 8]
        [--page-size 16] [--target DIR] [--device auto] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SYSTEM_TEXT = (
    "You are a careful assistant for a company that builds edge and cloud software. Answer briefly, cite the "
    "relevant policy when one applies, never invent facts, and say when you do not know. Policies: refunds within "
    "thirty days with a receipt; support hours are nine to five on weekdays; security issues go to the security "
    "team at once; personal data is never shared with third parties without consent. "
)
QUESTIONS = [
    "What are the support hours?", "Can I get a refund after two weeks?", "Who handles security issues?",
    "Do you share my data?", "Is support open on Sunday?", "How long is the refund window?",
    "What should I do if I find a bug?", "Can I call at eight in the morning?", "Do I need a receipt?",
    "Who do I tell about a leaked password?", "Is my email address sold?", "Can you refund a gift?",
    "What happens after thirty days?", "Are you open on holidays?", "Can I get help at noon?",
    "What is the policy on personal data?", "How do I report a vulnerability?", "Are refunds in cash?",
]


def _prefix_ids(tokenizer, n: int) -> list[int]:
    """Exactly ``n`` token ids of the repeated system text."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(SYSTEM_TEXT, add_special_tokens=False)
    return ids[:n]


def _batch_tokens() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("specdec_batch_tokens_sum") or 0.0


def _decode(backend, opened, max_new_tokens: int) -> list[int]:
    """Target-only greedy decoding of an open session (empty draft blocks) to its end."""
    from specdec_runtime.common.types import DraftBlock

    out, seq, length = [], 1, opened.committed_length
    while True:
        v = backend.submit(opened.session_id, seq, length, DraftBlock([])).result(120)
        out += v.committed_token_ids
        length, seq = v.committed_length, seq + 1
        if v.finished or len(out) >= max_new_tokens:
            return out


def _run_mode(runner, prompts: list[list[int]], max_new_tokens: int, caching: bool) -> dict:
    """Open every prompt in turn (timed), count KV pages in use, decode, close; the report of one mode."""
    from specdec_runtime.common.types import OpenRequest, SamplingParams, StoppingCriteria
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec.embedded import LocalBackend

    backend = LocalBackend(Verifier(runner, max_batch_wait_ms=0.0, prefix_caching=caching))
    try:
        runner.prefix_cache.evict_all()  # every mode starts cold
        greedy = SamplingParams(), StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True)
        warm = backend.open_session(OpenRequest(prompts[0][-8:], *greedy))  # first forward passes are slower: not timed
        backend.close_session(warm.session_id)
        open_s, opened = [], []
        before = _batch_tokens()
        for prompt in prompts:
            t0 = time.perf_counter()
            opened.append(backend.open_session(OpenRequest(prompt, *greedy)))
            open_s.append(time.perf_counter() - t0)
        prefilled = _batch_tokens() - before
        pages_in_use = runner.kv_pool.pages.num_used
        outputs = [_decode(backend, o, max_new_tokens) for o in opened]
        for o in opened:
            backend.close_session(o.session_id)
    finally:
        backend.close()
    rest = open_s[1:]
    return {
        "open_s_first": round(open_s[0], 4),
        "open_s_rest_median": round(statistics.median(rest), 4) if rest else None,
        "rest_over_first": round(statistics.median(rest) / open_s[0], 3) if rest else None,
        "open_s": [round(t, 4) for t in open_s],
        "prefilled_tokens": int(prefilled),
        "kv_pages_in_use": pages_in_use,
        "outputs": outputs,
    }


def run(sessions: int, prefix_tokens: int, max_new_tokens: int, page_size: int, target: str | None,
        device: str, dtype: str) -> dict:
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.common.paths import default_model_paths

    runner = TargetRunner(target or default_model_paths().target_dir, device=device, dtype=dtype,
                          kv_page_size=page_size, kv_cache_budget_tokens=(sessions + 2) * (prefix_tokens + 64))
    prefix = _prefix_ids(runner.tokenizer, prefix_tokens)
    questions = [runner.tokenizer.encode(" " + q, add_special_tokens=False) for q in QUESTIONS]
    prompts = [prefix + questions[i % len(questions)] + ([i] if i >= len(questions) else []) for i in range(sessions)]
    on = _run_mode(runner, prompts, max_new_tokens, caching=True)
    off = _run_mode(runner, prompts, max_new_tokens, caching=False)
    identical = on.pop("outputs") == off.pop("outputs")
    return {
        "model": str(runner.model_dir.name), "device": str(runner.device), "dtype": str(runner.dtype).split(".")[-1],
        "sessions": sessions, "prefix_tokens": prefix_tokens, "page_size": page_size,
        "prefix_caching": on, "no_prefix_caching": off,
        "kv_pages_ratio": round(on["kv_pages_in_use"] / off["kv_pages_in_use"], 3),
        "outputs_identical": identical,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=500)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--target", default=None, help="target model directory (default: the prepared model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    a = p.parse_args(argv)
    if a.sessions < 2 or a.prefix_tokens < 1 or a.max_new_tokens < 1 or a.page_size < 1:
        p.error("--sessions must be >= 2; --prefix-tokens, --max-new-tokens and --page-size >= 1")
    print(json.dumps(run(a.sessions, a.prefix_tokens, a.max_new_tokens, a.page_size, a.target, a.device, a.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
