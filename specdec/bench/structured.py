"""Constrained vs unconstrained speculative decoding, side by side in one run (prints one JSON object).

Four arms over the same prompts, greedy, embedded verifier: target-only and speculative decoding, each without
and with the grammar of ``--json-schema FILE``. The JSON reports tokens/s per arm, the constrained speedup of
speculative over target-only next to the unconstrained one, the forced tokens drafted for free, and the grammar's
cost per position (``GrammarMatcher.block_masks`` over each output, ms per position: the verifier's work per row).
Greedy constrained outputs of the two constrained arms must be equal (checked, reported).

    python3 -m specdec.bench.structured --json-schema FILE [--target DIR] [--draft DIR] [--prompts N]
        [--max-new-tokens N] [-g GAMMA]
    specdec bench --json-schema FILE [--target DIR] [--draft DIR] [--limit N] [--max-new-tokens N] [-g GAMMA]
        [--json]   (the same report; JSON on stdout either way)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPTS = ["Describe a person as JSON.", "Give me a product record.", "A city and its facts, as JSON.",
           "Reply with a JSON object about a book.", "JSON for a movie.", "A pet, in JSON.",
           "Describe a car as JSON.", "Weather report as JSON."]


def _arm(client, prompts, max_new_tokens, grammar):
    t0 = time.perf_counter()
    outs, forced, tokens = [], 0, 0
    for ids in prompts:
        r = client.generate(list(ids), max_new_tokens=max_new_tokens, grammar=grammar)
        outs.append(r.token_ids)
        forced += r.stats.num_forced_tokens
        tokens += r.stats.num_generated_tokens
    dt = time.perf_counter() - t0
    return {"tokens": tokens, "elapsed_s": dt, "tokens_per_s": tokens / dt if dt else 0.0,
            "num_forced_tokens": forced}, outs


def _grammar_cost_ms(spec, tokenizer, outputs) -> float:
    from specdec_runtime.common.grammar import compile_grammar, grammar_tokenizer

    compiled = compile_grammar(spec, grammar_tokenizer(tokenizer, [int(tokenizer.eos_token_id)]))
    positions, t = 0, 0.0
    for out in outputs:
        m = compiled.matcher()
        t0 = time.perf_counter()
        m.block_masks(out[:-1] if out and out[-1] == tokenizer.eos_token_id else out)
        t += time.perf_counter() - t0
        positions += len(out)
    return t * 1e3 / max(1, positions)


def run_structured(json_schema: Path, *, target=None, draft=None, limit: int | None = None,
                   max_new_tokens: int = 96, num_speculative_tokens: int = 4) -> dict:
    """The four arms over ``limit`` prompts (default: all of :data:`PROMPTS`) under the schema in the file
    ``json_schema``; returns the report (keys: the module docstring). ``max_new_tokens``: tokens per output.

    Raises:
        InvalidRequestError: the file cannot be read, or is not a JSON schema (one line for the CLI)."""
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.common.errors import InvalidRequestError
    from specdec_runtime.common.grammar import GrammarSpec
    from specdec_runtime.common.paths import resolve_draft_dir, resolve_target_dir
    from specdec_runtime.edge_client.client import EdgeClient, encode_prompt
    from specdec_runtime.edge_client.drafting.drafter import ModelDrafter
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec.embedded import LocalBackend

    try:
        spec = GrammarSpec.json_schema(Path(json_schema).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidRequestError(f"--json-schema {json_schema}: {e}") from None
    backend = LocalBackend(Verifier(TargetRunner(resolve_target_dir(target))))
    model = OnnxDraftModel(resolve_draft_dir(draft))
    tok = model.tokenizer
    prompts = [encode_prompt(tok, p) for p in (PROMPTS * 4)[: limit or len(PROMPTS)]]
    spec_client = EdgeClient(backend, ModelDrafter(model), tok, num_speculative_tokens=num_speculative_tokens)
    target_only = EdgeClient(backend, None, tok)
    report: dict = {"mode": "structured", "schema": str(json_schema), "prompts": len(prompts),
                    "max_new_tokens": max_new_tokens}
    outs = {}
    try:
        for name, client, grammar in (("target_only", target_only, None), ("speculative", spec_client, None),
                                      ("target_only_constrained", target_only, spec),
                                      ("speculative_constrained", spec_client, spec)):
            report[name], outs[name] = _arm(client, prompts, max_new_tokens, grammar)
    finally:
        backend.close()
    rate = {k: report[k]["tokens_per_s"] for k in outs}
    report["speedup_unconstrained"] = rate["speculative"] / rate["target_only"] if rate["target_only"] else None
    report["speedup_constrained"] = (rate["speculative_constrained"] / rate["target_only_constrained"]
                                     if rate["target_only_constrained"] else None)
    report["constrained_outputs_equal"] = outs["speculative_constrained"] == outs["target_only_constrained"]
    report["grammar_ms_per_position"] = _grammar_cost_ms(spec, tok, outs["speculative_constrained"])
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-schema", required=True, type=Path)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("-g", "--num-speculative-tokens", type=int, default=4)
    args = ap.parse_args()
    print(json.dumps(run_structured(args.json_schema, target=args.target, draft=args.draft, limit=args.prompts,
                                    max_new_tokens=args.max_new_tokens,
                                    num_speculative_tokens=args.num_speculative_tokens), indent=1))


if __name__ == "__main__":
    main()
