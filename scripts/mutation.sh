#!/usr/bin/env bash
# Mutation testing of the core with mutmut 3 (docs/testing.md, "Mutation testing"). Not in CI (~20-30 min on 2 cores).
#
# Scope (pyproject.toml [tool.mutmut] + the name filter below): common/rejection.py, the sampling maths
# (common/sampling.py, logits.py, top_p.py, draft_topk.py), common/stopping.py, cloud_verifier/session/validation.py,
# cloud_verifier/verdict/numerics.py, and of cloud_verifier/batcher.py the verdict of the verify step, Batcher._apply_verdict.
# Each mutant runs only the tests that executed its function (mutmut's per-function test mapping from a first,
# instrumented run of the selected test files).
#
# Runs in a fresh copy of the tree (default a new /tmp/specdec-mutation.* directory; SPECDEC_MUTATION_DIR to choose),
# so the working tree gets no mutants/ directory and edits made meanwhile do not mix into the run.
# Needs Redis like the tests (SPECDEC_TEST_REDIS_URL, default redis://127.0.0.1:6379/15) and the tiny-model fixtures.
# Env: SPECDEC_MUTATION_TIMEOUT_S (default 1800), SPECDEC_MUTATION_JOBS (default: CPU count).
# Output: mutmut's progress, each surviving mutant, then as the LAST line one JSON object
#   {"modules": {"common/rejection.py": {"killed": k, "total": n}, ...}}
# Inspect a survivor afterwards: cd <dir> && mutmut show <name>.
set -euo pipefail

main() {
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import mutmut, sys; sys.exit(int(mutmut.__version__.split(".")[0]) != 3)' 2>/dev/null; then
    echo "installing mutmut 3 (the [mutation] extra)" >&2
    "$PY" -m pip install -q "mutmut>=3.8,<4" >&2
fi

WORK="${SPECDEC_MUTATION_DIR:-$(mktemp -d /tmp/specdec-mutation.XXXXXX)}"
mkdir -p "$WORK"
rm -rf "$WORK/mutants"
# the tree mutmut sees: the mutated packages, the tests and the config (the other packages, e.g. specdec and
# edge_client, are imported from the installed tree)
tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' -cf - common cloud_verifier tests pyproject.toml \
    | tar -C "$WORK" -xf -
cd "$WORK"
echo "mutation testing in $WORK (mutmut $("$PY" -c 'import mutmut; print(mutmut.__version__)'))" >&2

export SPECDEC_TEST_REDIS_URL="${SPECDEC_TEST_REDIS_URL:-redis://127.0.0.1:6379/15}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# mutants run in processes forked from mutmut's: single-threaded torch/BLAS is fork-safe (and 2 children on 2 cores)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# scripts/mutation_pytest_order.py (-p mutation_pytest_order in [tool.mutmut]): each mutant's tests fastest first
export PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
# the CPUs this process may use (not nproc: it obeys OMP_NUM_THREADS)
JOBS="${SPECDEC_MUTATION_JOBS:-$("$PY" -c 'import os; print(len(os.sched_getaffinity(0)))')}"
mapfile -t PATTERNS < <("$PY" "$ROOT/scripts/mutation_summary.py" --patterns)  # the scope, by mutant name
status=0
timeout --signal=INT --kill-after=60 "${SPECDEC_MUTATION_TIMEOUT_S:-1800}" \
    mutmut run --max-children "$JOBS" "${PATTERNS[@]}" > mutmut.log 2>&1 || status=$?
# mutmut redraws its progress line with \r: show its last progress line and its rate
"$PY" - <<'PYEOF' >&2 || true
text = open("mutmut.log", encoding="utf-8", errors="replace").read()
lines = [line.strip() for line in text.replace("\r", "\n").split("\n")]
progress = [line for line in lines if "/" in line and "🎉" in line]
notes = [line for line in lines if "mutations/second" in line or "rror" in line][-5:]
print("\n".join(progress[-1:] + notes))
PYEOF
if [ "$status" -ne 0 ]; then
    echo "mutmut exited with status $status (124/130: time limit; the counts below are what finished)" >&2
fi
"$PY" "$ROOT/scripts/mutation_summary.py" mutants
}

main "$@"
