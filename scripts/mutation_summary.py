"""Summarise a mutmut 3 run (scripts/mutation.sh): per core module, killed / total mutants in scope.

Reads mutmut's per-file results (``mutants/<path>.meta``, JSON: ``exit_code_by_key`` = mutant name -> the exit
code of its test run) in the current directory. A mutant counts as killed when its tests failed (exit codes 1, 3)
or it ran into the CPU-time limit (SIGXCPU: -24, 24, 152; an endless loop is a detected change too); every
other state (survived 0, no tests 33/5, not checked None, suspicious, segfault) counts against the score.
``batcher.py`` is in scope only through ``Batcher._apply_verdict`` (the verdict of the verify step);
the sampling maths (``sampling.py``, ``logits.py``, ``top_p.py``, ``draft_topk.py``) without the test oracles
(the plain implementations the fast path is checked against). ``--patterns`` prints the mutant-name patterns, one
a line (for ``mutmut run``).

Prints each survivor (name and status), then, as its last line, one JSON object:
``{"modules": {"common/rejection.py": {"killed": k, "total": n}, ...}}``.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path

# module -> mutant-name patterns in scope (mutmut names: "<module>.x_<function>__mutmut_<i>", methods
# "<module>.xǁ<Class>ǁ<method>__mutmut_<i>")
# the sampling maths, by module (the plain full-sort implementations the fast path is checked against are out of
# scope: logits_to_probs_reference lives in specdec/logits_reference.py, top_p_drop_reference is a fallback)
SAMPLING_FUNCTIONS = {
    "common/sampling.py": ("specdec_runtime.common.sampling", ["x_uniform", "x_sample_from", "x_normalize_sparse",
                                               "x_dense_draft_probs"]),
    "common/logits.py": ("specdec_runtime.common.logits", ["x_logits_to_probs", "x__scale"]),
    "common/top_p.py": ("specdec_runtime.common.top_p", ["x__top_p_keep", "x__top_p_round", "x__negative_ramp",
                                         "x__top_candidates"]),
    "common/draft_topk.py": ("specdec_runtime.common.draft_topk", ["x_draft_topk_from_probs"]),
}
SCOPE = {
    "common/rejection.py": ["common.rejection.*"],
    **{path: [f"{module}.{f}__mutmut_*" for f in functions]
       for path, (module, functions) in SAMPLING_FUNCTIONS.items()},
    "common/stopping.py": ["common.stopping.*"],
    "cloud_verifier/session/validation.py": ["cloud_verifier.session.validation.*"],
    "cloud_verifier/verdict/numerics.py": ["cloud_verifier.verdict.numerics.*"],
    "cloud_verifier/batcher.py": ["cloud_verifier.batcher.xǁBatcherǁ_apply_verdict__mutmut_*"],
}
KILLED = {1, 3, -24, 24, 152}
STATUS = {0: "survived", 33: "no tests", 5: "no tests", None: "not checked", 36: "timeout", -11: "segfault",
          -9: "killed by SIGKILL"}


def main(root: Path = Path("mutants")) -> int:
    modules = {}
    survivors = []
    for module, patterns in SCOPE.items():
        meta = root / (module + ".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.is_file() else {}
        in_scope = {k: v for k, v in codes.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
        killed = sum(1 for v in in_scope.values() if v in KILLED)
        modules[module] = {"killed": killed, "total": len(in_scope)}
        survivors += [(k, STATUS.get(v, f"exit {v}")) for k, v in sorted(in_scope.items()) if v not in KILLED]
    for name, status in survivors:
        print(f"{status}: {name}")
    killed, total = (sum(m[k] for m in modules.values()) for k in ("killed", "total"))
    print(f"killed {killed} of {total} mutants ({100 * killed / max(total, 1):.1f} %)")
    print(json.dumps({"modules": modules}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--patterns"]:
        print("\n".join(p for patterns in SCOPE.values() for p in patterns))
        sys.exit(0)
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("mutants")))
