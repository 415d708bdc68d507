"""`specdec generate --server` on an edge install with nothing prepared (an empty SPECDEC_CACHE_DIR, torch,
transformers and the verifier's package blocked: tests/_edge_only.py): the draft comes from the verifier (progress
on stderr), the output is token-identical to target-only decoding, a second run fetches nothing, and `--route
cloud` fetches only the tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _reference import hf_greedy

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # 3-8 s: three CLI subprocesses on 2 busy cores

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PROMPT = "Name three colors."
MAX_NEW = 12
_PRELUDE = "import _edge_only, sys, json, atexit\n" \
           "atexit.register(lambda: print('MODULES ' + json.dumps(sorted(_edge_only.root(m) for m in sys.modules)), " \
           "file=sys.stderr))\n"


@pytest.fixture(scope="module")
def delivering_verifier(tiny_pair, tmp_path_factory):
    from specdec.embedded import EmbeddedServer
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, publish_draft
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    root = tmp_path_factory.mktemp("cli-drafts")
    publish_draft(tiny_pair.draft_dir, root, "tiny", "v1")
    verifier = Verifier(TargetRunner(tiny_pair.target_dir, kv_cache_budget_tokens=8192), max_batch_wait_ms=0.0)
    with EmbeddedServer(verifier=verifier, grace_s=1.0, drafts=DraftCatalog(root)) as address:
        yield address


@pytest.fixture(scope="module")
def expected(tiny_pair):
    from transformers import AutoTokenizer

    from specdec_runtime.edge_client.request import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target_dir)
    return hf_greedy(tiny_pair.target_dir, encode_prompt(tokenizer, PROMPT), MAX_NEW)


def _specdec(argv: list[str], cache: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    """``specdec ARGV`` on the edge-only install (a subprocess); checks it succeeded with none of the
    verifier's modules loaded."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), "SPECDEC_CACHE_DIR": str(cache)}
    env.pop("SPECDEC_API_KEY", None)
    argv = ["specdec", *argv]
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + f"sys.argv = {argv!r}\nfrom specdec.cli import app\napp()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, input=stdin)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    modules = set(json.loads(proc.stderr.rsplit("MODULES ", 1)[1]))
    assert not modules & {"torch", "transformers", "cloud_verifier"}, modules
    return proc


def _generate(address: str, cache: Path, *args: str) -> tuple[dict, str]:
    proc = _specdec(["generate", PROMPT, "--server", address, "--json", "--max-new-tokens", str(MAX_NEW),
                     "--ignore-eos", *args], cache)
    return json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1]), proc.stderr


def test_fresh_edge_install_fetches_the_draft_once(delivering_verifier, expected, tmp_path):
    out, err = _generate(delivering_verifier, tmp_path)
    assert "draft: model.onnx" in err and "draft: tiny@v1 from the verifier, fetched" in err  # progress shown
    assert out["token_ids"] == expected and out["num_draft_tokens"] > 0
    out, err = _generate(delivering_verifier, tmp_path)
    assert "draft: tiny@v1 from the verifier, cached" in err and "draft: model.onnx" not in err
    assert out["token_ids"] == expected
    target_only, _ = _generate(delivering_verifier, tmp_path, "--target-only")
    assert target_only["token_ids"] == expected and target_only["num_draft_tokens"] == 0


def test_cloud_route_fetches_only_the_tokenizer(delivering_verifier, expected, tmp_path):
    out, err = _generate(delivering_verifier, tmp_path, "--route", "cloud")
    assert "(tokenizer only)" in err and "draft: model.onnx" not in err
    assert out["token_ids"] == expected
    assert not list(tmp_path.rglob("model.onnx"))


def test_flipped_byte_through_the_cli_is_refused_and_fetched_again(delivering_verifier, expected, tmp_path):
    """A proxy between `specdec generate --server` and the verifier flips one byte of the FetchDraft stream: the
    file fails its sha256, is fetched again, and the output is target-only decoding's."""
    from _proxy import ByteFlippingProxy

    proxy = ByteFlippingProxy(int(delivering_verifier.rsplit(":", 1)[1]))
    try:
        proxy.flip_next()
        out, err = _generate(f"127.0.0.1:{proxy.port}", tmp_path)
    finally:
        proxy.close()
    assert proxy.num_flipped == 1
    assert "refused" in err and "(1 refused: sha256 mismatch, fetched again)" in err, err
    assert out["token_ids"] == expected and out["num_draft_tokens"] > 0


def test_chat_fetches_the_draft(delivering_verifier, tmp_path):
    """`specdec chat --server` with nothing prepared fetches the draft too; its reply is the target-only one."""
    argv = ["chat", "--server", delivering_verifier, "--max-new-tokens", str(MAX_NEW)]
    proc = _specdec(argv, tmp_path, stdin=PROMPT + "\n")
    assert "draft: tiny@v1 from the verifier, fetched" in proc.stderr and proc.stdout.strip()
    reference = _specdec([*argv, "--target-only"], tmp_path, stdin=PROMPT + "\n")
    assert "(tokenizer only)" in reference.stderr
    assert proc.stdout == reference.stdout
