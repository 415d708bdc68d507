"""KV-cache memory is given back when sessions close: the budget counters, the Prometheus gauge, AND the memory
actually held.

The counters (``TargetRunner.kv_reserved_bytes`` and the ``specdec_kv_cache_used_bytes`` gauge) count the KV pages
sessions hold in the paged pool: the pages of the tokens actually held (committed but the last, whole pages),
not a worst case reserved at open. They only say what the accounting believes, so the memory held is measured
too, two ways, each with a bound derived from the size of one session's cache:

- live tensors: the bytes of every distinct tensor storage reachable by Python's garbage collector
  (``gc.get_objects()``), before, during and after a batch of sessions has been opened, used and closed: the KV
  lives in the one pool allocated with the runner, so no session adds tensors (growth below ONE session's cache);
- resident memory (RSS, psutil, in a child process with a fixed malloc mmap threshold, see RSS_DRIVER): after
  sessions whose prompts fill most of their cache (pool pages only count once written) are opened, used and
  closed, RSS must be back within half of one session's written cache of the baseline (a closed session's free
  pages are given back to the OS; this also sees memory held where the garbage collector cannot look).

The target is a wide 2-layer random Llama (16 KV heads × 32, 2,048-token context: 8 KiB of KV per token, 16 MiB per
full-context session) so that one session's cache stands well above allocator noise.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, StoppingCriteria
from specdec.embedded import LocalBackend

pytestmark = pytest.mark.timeout(180)

CONTEXT = 2048
WAIT_S = 60.0
MiB = 1 << 20


@pytest.fixture(scope="module")
def wide_target_dir(tmp_path_factory, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=CONTEXT, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("wide-target")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runner(wide_target_dir):
    runner = TargetRunner(wide_target_dir, kv_cache_budget_tokens=16 * CONTEXT)
    assert runner.kv_bytes_per_token == 2 * 2 * 16 * 32 * 4  # layers · (K, V) · heads · head_dim · fp32
    return runner


@pytest.fixture()
def backend(runner):
    b = LocalBackend(Verifier(runner, max_num_speculative_tokens=4, max_batch_wait_ms=0.0))
    yield b
    b.close()


def gauge_used() -> float:
    return REGISTRY.get_sample_value("specdec_kv_cache_used_bytes") or 0.0


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of all live tensors the garbage collector can reach."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":  # type(): no __class__ lookups
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except Exception:  # noqa: BLE001 - sparse / meta tensors, and the FakeTensors torch.compile caches
                continue  # (tests/cloud_verifier/test_compiled_forward.py) have no data
            if ptr:
                seen[ptr] = storage.nbytes()
    return sum(seen.values())


LENGTHS: dict[str, int] = {}  # session id -> committed length after run_session


def held_bytes(runner, sid: str) -> int:
    """KV bytes a session holds after its blocks: whole pages for its committed tokens but the last."""
    bs = runner.kv_page_size
    return -(-(LENGTHS[sid] - 1) // bs) * bs * runner.kv_bytes_per_token


def run_session(backend, prompt_len: int, max_new_tokens: int, seed: int) -> str:
    """Open a session, verify two blocks, leave it open; returns its id (its committed length in LENGTHS)."""
    prompt = [(seed * 7919 + 13 * i) % 1000 + 3 for i in range(prompt_len)]
    opened = backend.open_session(OpenRequest(prompt, SamplingParams(),
                                              StoppingCriteria(max_new_tokens, ignore_eos=True)), timeout_s=WAIT_S)
    length = opened.committed_length
    for seq in (1, 2):
        verdict = backend.submit(opened.session_id, seq, length, DraftBlock([5, 6, 7])).result(timeout=WAIT_S)
        length = verdict.committed_length
    LENGTHS[opened.session_id] = length
    return opened.session_id


def test_counters_follow_open_and_close(backend, runner):
    assert runner.kv_reserved_bytes == 0  # (the gauge is process-wide: it follows this verifier from its first update)
    specs = [(10, 50), (300, 200), (1500, CONTEXT)]  # max_new_tokens reserves nothing: only tokens held count
    sids, expected = [], 0
    for i, (prompt_len, max_new) in enumerate(specs):
        sids.append(run_session(backend, prompt_len, max_new, seed=i))
        expected += held_bytes(runner, sids[-1])
        assert prompt_len * runner.kv_bytes_per_token <= held_bytes(runner, sids[-1])
        assert runner.kv_reserved_bytes == expected
        assert gauge_used() == expected
    for sid in sids:
        backend.close_session(sid)
        expected -= held_bytes(runner, sid)
        assert runner.kv_reserved_bytes == expected and gauge_used() == expected
    assert runner.kv_reserved_bytes == 0 and gauge_used() == 0


def test_live_tensor_bytes_return_after_close(backend, runner):
    session_bytes = 200 * runner.kv_bytes_per_token  # the smallest cache of this test: 100 + 100 tokens
    run_session(backend, 8, 8, seed=99)  # warm-up: first-use allocations of torch and the verifier
    backend.close_session(run_session(backend, 8, 8, seed=98))
    before, reserved = live_tensor_bytes(), runner.kv_reserved_bytes  # (the warm-up session stays open)
    sids = [run_session(backend, 100, 100 + 50 * i, seed=i) for i in range(4)]
    during = live_tensor_bytes()
    assert runner.kv_reserved_bytes - reserved == sum(held_bytes(runner, sid) for sid in sids) > 0
    assert during - before < session_bytes  # the pool holds them: no tensor per session
    for sid in sids:
        backend.close_session(sid)
    after = live_tensor_bytes()
    assert after - before < session_bytes, (
        f"{(after - before) / MiB:.2f} MiB of tensors still alive after closing every session "
        f"(one session's cache: {session_bytes / MiB:.2f} MiB)"
    )


# Resident memory is measured in a child process whose glibc malloc has a fixed mmap threshold
# (MALLOC_MMAP_THRESHOLD_): with the default dynamic threshold, freed multi-MiB buffers are often kept in malloc's
# arenas for reuse and RSS says little about what is still referenced; with a fixed one, every allocation of 1 MiB
# or more is its own mapping, returned to the kernel when freed, so RSS follows the live KV buffers exactly.
RSS_DRIVER = r"""
import gc, json, sys
import psutil
from specdec_runtime.cloud_verifier.target.runner import TargetRunner
from specdec_runtime.cloud_verifier.verifier import Verifier
from specdec_runtime.common.types import DraftBlock, OpenRequest, SamplingParams, StoppingCriteria
from specdec.embedded import LocalBackend

target_dir, prompt_len, context, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
runner = TargetRunner(target_dir, kv_cache_budget_tokens=4 * context)
# prefix caching off: cached pages of closed sessions stay resident by design (until evicted for reuse)
backend = LocalBackend(Verifier(runner, max_num_speculative_tokens=4, max_batch_wait_ms=0.0, prefix_caching=False))

def rss():
    gc.collect()
    return psutil.Process().memory_info().rss

def session(seed):
    prompt = [(seed * 7919 + 13 * i) % 1000 + 3 for i in range(prompt_len)]
    opened = backend.open_session(OpenRequest(prompt, SamplingParams(),
                                              StoppingCriteria(context - prompt_len, ignore_eos=True)), timeout_s=60)
    length = opened.committed_length
    for seq in (1, 2):
        length = backend.submit(opened.session_id, seq, length, DraftBlock([5, 6, 7])).result(60).committed_length
    return opened.session_id

for warm in (100, 101):  # warm-up at the same size
    backend.close_session(session(warm))
before = rss()
sid = session(0)
open_rss = rss()
backend.close_session(sid)
released = open_rss - rss()  # what closing it gave back (before itself may hold the warm-up's transients)
after = []
for i in range(1, n + 1):
    backend.close_session(session(i))
    after.append(rss() - before)
print(json.dumps({"while_open": open_rss - before, "released": released, "after_close": after, "reserved": runner.kv_reserved_bytes,
                  "per_token": runner.kv_bytes_per_token}))
backend.close()
"""


@pytest.mark.slow  # 26-33 s measured
def test_resident_memory_returns_after_close(wide_target_dir):
    prompt_len, n = 1800, 4
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MiB), OMP_WAIT_POLICY="PASSIVE",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", RSS_DRIVER, str(wide_target_dir), str(prompt_len), str(CONTEXT),
                           str(n)], env=env, capture_output=True, text=True, timeout=150, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    touched = prompt_len * data["per_token"]  # resident bytes of one session's cache (what its prefill wrote)
    assert data["released"] > 0.8 * touched, data  # the measurement sees one open session's cache go
    assert data["reserved"] == 0
    growth = max(data["after_close"])
    assert growth < touched / 2, (
        f"RSS {growth / MiB:.1f} MiB above the baseline after closing every session, one session's cache being "
        f"{touched / MiB:.1f} MiB: {[round(g / MiB, 1) for g in data['after_close']]}"
    )
