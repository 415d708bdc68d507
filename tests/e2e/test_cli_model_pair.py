"""Bring your own pair, as a user runs it: the `specdec` CLI in a subprocess with a non-Llama pair.

A tiny random Qwen2 target (tests/_architectures.py, SmolLM2's tokenizer) and its own ONNX export as the draft,
made by the test: ``specdec generate --target DIR --draft DIR --json`` (embedded verifier over loopback gRPC) and
``generate --server`` against a ``specdec serve`` subprocess both give greedy token ids identical to
``generate --target-only`` and to HF ``generate``. A hybrid target (tiny LFM2: a short-conv layer, its state kept
per session) with a tiny Llama draft sharing its embeddings (drafts rejected often) does the same through
``generate --target --draft``. An architecture the verifier cannot run (pure Mamba2: no attention layer) is refused
through the CLI with one ``error:`` line naming what is missing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _architectures import REFUSED
from _reference import hf_greedy
from specdec_runtime.cloud_verifier.serving.healthcheck import check
from specdec_runtime.edge_client.client import encode_prompt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Name three colors."
MAX_NEW = 16
ARCH = "qwen2"


@pytest.fixture(scope="module")
def qwen2_pair(arch_models):
    """(target HF dir, ONNX fp32 draft dir) of the tiny Qwen2 model; the draft is the target's own export
    (tests/e2e/conftest.py: the same pair test_architectures.py checks)."""
    return arch_models(ARCH)


@pytest.fixture(scope="module")
def expected_ids(qwen2_pair):
    """Plain HF greedy continuation of the chat-templated PROMPT, as the CLI encodes it."""
    from transformers import AutoTokenizer

    hf_dir, _ = qwen2_pair
    return hf_greedy(hf_dir, encode_prompt(AutoTokenizer.from_pretrained(hf_dir), PROMPT), MAX_NEW)


def _env(**extra: str) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1", **extra)
    env.pop("SPECDEC_REDIS_URL", None)  # the in-process session store
    return env


def _cli_generate(*args: str) -> dict:
    """`specdec generate PROMPT --json ...` in a subprocess; its JSON line."""
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", PROMPT, "--json", "--ignore-eos",
                           "--max-new-tokens", str(MAX_NEW), *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])


def test_generate_with_a_qwen2_pair_equals_target_only(qwen2_pair, expected_ids):
    hf_dir, onnx_dir = qwen2_pair
    spec = _cli_generate("--target", str(hf_dir), "--draft", str(onnx_dir))
    plain = _cli_generate("--target", str(hf_dir), "--target-only")
    assert spec["token_ids"] == plain["token_ids"] == expected_ids
    assert spec["text"] == plain["text"]
    assert plain["num_draft_tokens"] == 0
    assert spec["num_draft_tokens"] > 0 and spec["acceptance_rate"] > 0.8  # the draft is the target in ONNX
    assert spec["num_drafts"] < MAX_NEW  # speculation saved verify steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_a_qwen2_target_then_generate_over_grpc(qwen2_pair, expected_ids):
    hf_dir, onnx_dir = qwen2_pair
    port = _free_port()
    env = _env(SPECDEC_TARGET=str(hf_dir), SPECDEC_HOST="127.0.0.1", SPECDEC_PORT=str(port),
               SPECDEC_METRICS_PORT="0", SPECDEC_GRACE_PERIOD_S="2")
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if check(address, timeout_s=2.0) == "SERVING":
                    break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.3)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        out = _cli_generate("--server", address, "--draft", str(onnx_dir))
        assert out["token_ids"] == expected_ids
        assert out["num_draft_tokens"] > 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def mamba2_dir(arch_models):
    return arch_models("mamba2", export=False)[0]


def test_generate_with_a_hybrid_lfm2_target_equals_target_only(arch_models):
    from transformers import AutoTokenizer

    hf_dir, onnx_dir = arch_models("lfm2")  # the draft: a sibling Llama sharing the target's embeddings
    spec = _cli_generate("--target", str(hf_dir), "--draft", str(onnx_dir))
    plain = _cli_generate("--target", str(hf_dir), "--target-only")
    expected = hf_greedy(hf_dir, encode_prompt(AutoTokenizer.from_pretrained(hf_dir), PROMPT), MAX_NEW)
    assert spec["token_ids"] == plain["token_ids"] == expected
    assert spec["num_draft_tokens"] > spec["num_accepted_tokens"] > 0  # drafts accepted and rejected


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]  # one line, no traceback
    assert lines[0].startswith("error:")
    return lines[0]


def test_unsupported_architecture_refused_by_serve_in_one_line(mamba2_dir):
    env = _env(SPECDEC_TARGET=str(mamba2_dir), SPECDEC_HOST="127.0.0.1", SPECDEC_PORT=str(_free_port()),
               SPECDEC_METRICS_PORT="0")
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "serve"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert REFUSED["mamba2"] in _one_error_line(proc)


def test_unsupported_architecture_refused_by_generate_in_one_line(mamba2_dir):
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", PROMPT, "--target", str(mamba2_dir),
                           "--target-only", "--max-new-tokens", "4"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=180)
    assert REFUSED["mamba2"] in _one_error_line(proc)
