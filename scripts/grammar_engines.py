"""Measure the two grammar engines on the target's vocabulary: xgrammar vs llguidance (prints one JSON object).

For each engine: import time, tokenizer setup, compile time of a JSON schema (cold), per-token mask time walking a
fixed valid JSON document token by token (mean / p50 / p99 in ms), roll-back cost, and the resident memory it
added (RSS, MiB). What each wheel pulls in is read from its installed metadata (``Requires-Dist``): the edge
install has no torch, so an engine that requires it cannot run on the device.

    python3 scripts/grammar_engines.py [--target DIR] [--engines llguidance,xgrammar]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "kind": {"enum": ["person", "robot", "alien"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
    "additionalProperties": False,
}
DOCUMENT = ('{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], '
            '"address": {"city": "London", "zip": "W1"}, "kind": "person"}')


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _requires(dist: str) -> list[str]:
    reqs = md.requires(dist) or []
    return [r.split(";")[0].strip() for r in reqs if "extra ==" not in r]


def _summary(times_ms: list[float]) -> dict:
    s = sorted(times_ms)
    return {"mean_ms": statistics.fmean(s), "p50_ms": s[len(s) // 2], "p99_ms": s[min(len(s) - 1, int(len(s) * .99))]}


def bench_llguidance(target: Path, ids: list[int]) -> dict:
    rss0, t0 = _rss_mib(), time.perf_counter()
    import llguidance
    import llguidance.numpy
    import numpy as np
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer((target / "tokenizer.json").read_text(), eos_token=0)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    m = llguidance.LLMatcher(tok, grammar)
    assert not m.is_error(), m.get_error()
    t_compile = time.perf_counter() - t0
    mask = np.zeros((1, (tok.vocab_size + 31) // 32), dtype=np.int32)
    per = []
    for t in ids:
        t0 = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(m, mask)
        per.append((time.perf_counter() - t0) * 1e3)
        assert m.consume_token(t), m.get_error()
    t0 = time.perf_counter()
    m.rollback(len(ids))
    t_rb = time.perf_counter() - t0
    return {"version": md.version("llguidance"), "requires": _requires("llguidance"), "import_s": t_import,
            "tokenizer_s": t_tok, "compile_s": t_compile, "mask": _summary(per), "rollback_all_ms": t_rb * 1e3,
            "rss_added_mib": _rss_mib() - rss0, "vocab_size": tok.vocab_size}


def bench_xgrammar(target: Path, ids: list[int]) -> dict:
    rss0, t0 = _rss_mib(), time.perf_counter()
    import xgrammar as xgr
    from transformers import AutoTokenizer
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = AutoTokenizer.from_pretrained(target)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    m = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
    t_compile = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    per = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        per.append((time.perf_counter() - t0) * 1e3)
        assert m.accept_token(t)
    t0 = time.perf_counter()
    m.rollback(len(ids))
    t_rb = time.perf_counter() - t0
    return {"version": md.version("xgrammar"), "requires": _requires("xgrammar"), "import_s": t_import,
            "tokenizer_s": t_tok, "compile_s": t_compile, "mask": _summary(per), "rollback_all_ms": t_rb * 1e3,
            "rss_added_mib": _rss_mib() - rss0, "vocab_size": info.vocab_size}


def main() -> None:
    from specdec_runtime.common.paths import resolve_target_dir
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--engines", default="llguidance,xgrammar")
    args = ap.parse_args()
    target = resolve_target_dir(args.target)
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(target / "tokenizer.json")).encode(DOCUMENT, add_special_tokens=False).ids
    out = {"target": str(target), "document_tokens": len(ids),
           "peak_rss_before_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    for name in args.engines.split(","):
        try:
            out[name] = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}[name](target, ids)
        except Exception as e:  # an engine missing or failing is reported, the other still measured
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
