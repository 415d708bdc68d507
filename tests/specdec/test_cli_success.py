"""The `specdec` CLI's success paths, on content: `generate --json` in its four wirings (embedded verifier over
loopback gRPC, --in-process, --target-only, --server against a `specdec serve` subprocess), `serve` answering
health and exiting on SIGTERM, and `models prepare` being idempotent on the prepared default cache.

Greedy output must be token-identical to target-only greedy decoding with plain HF ``generate``; the JSON keys are
the documented ones (docs/cli.md, "generate --json": text, token_ids, finish_reason, num_generated_tokens,
num_drafts, num_draft_tokens, num_accepted_tokens, acceptance_rate, mean_accepted_length, elapsed_s, and the two
phases: ttft_s, num_decode_tokens, decode_s, decode_tokens_per_s) and their values consistent (never their size).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _reference import hf_greedy
from specdec_runtime.cloud_verifier.serving.healthcheck import check
from specdec_runtime.edge_client.client import encode_prompt
from specdec.cli import app

pytestmark = pytest.mark.timeout(300)

PROMPT = "Name three colors."
MAX_NEW = 12
JSON_KEYS = {"text", "token_ids", "finish_reason", "num_generated_tokens", "num_drafts", "num_draft_tokens",
             "num_accepted_tokens", "acceptance_rate", "mean_accepted_length", "elapsed_s", "ttft_s",
             "num_decode_tokens", "decode_s", "decode_tokens_per_s"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def expected(tiny_pair):
    """The tiny target's greedy continuation of the chat-templated PROMPT (plain HF generate) and its text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair.target_dir)
    ids = hf_greedy(tiny_pair.target_dir, encode_prompt(tok, PROMPT), MAX_NEW)
    return ids, tok.decode(ids, skip_special_tokens=True)


def _generate(*args: str) -> dict:
    result = CliRunner().invoke(app, ["generate", PROMPT, "--json", "--max-new-tokens", str(MAX_NEW), "--ignore-eos",
                                      *args])
    assert result.exit_code == 0, (result.output, result.stderr)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])


def _check(out: dict, expected, *, drafted: bool) -> None:
    ids, text = expected
    assert JSON_KEYS <= set(out), JSON_KEYS - set(out)  # the documented keys (newer ones may be added)
    assert "num_steps" not in out  # the key is num_drafts
    assert out.get("num_unverified_tokens", 0) == 0 and out.get("num_failovers", 0) == 0  # all verified, no failover
    assert out["token_ids"] == ids
    assert out["text"] == text
    assert out["finish_reason"] == "length"
    assert out["num_generated_tokens"] == len(out["token_ids"]) == MAX_NEW
    assert out["num_drafts"] >= 1 and out["elapsed_s"] > 0
    assert out["num_accepted_tokens"] <= out["num_draft_tokens"]
    # every verify step commits its accepted tokens plus one token of the target's
    assert out["num_accepted_tokens"] + out["num_drafts"] == MAX_NEW
    assert out["mean_accepted_length"] == pytest.approx(1 + out["num_accepted_tokens"] / out["num_drafts"])
    # the two phases: the prefill up to the first commit (one verify step: at most γ + 1 = 5 tokens), then decode
    assert 0 < out["ttft_s"] <= out["elapsed_s"]
    assert out["decode_s"] == pytest.approx(out["elapsed_s"] - out["ttft_s"])
    first = out["num_generated_tokens"] - out["num_decode_tokens"]
    assert 1 <= first <= (5 if drafted else 1)
    assert out["decode_tokens_per_s"] == pytest.approx(out["num_decode_tokens"] / out["decode_s"])
    if drafted:
        assert out["num_draft_tokens"] > 0
        assert out["acceptance_rate"] == pytest.approx(out["num_accepted_tokens"] / out["num_draft_tokens"])
        assert out["acceptance_rate"] > 0.5  # the draft is the target's own weights
        assert out["num_drafts"] < MAX_NEW  # speculation did save steps
    else:
        assert out["num_draft_tokens"] == 0 and out["acceptance_rate"] is None
        assert out["num_drafts"] == MAX_NEW


def _models(tiny_pair) -> list[str]:
    return ["--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir)]


def test_generate_json_embedded_verifier(tiny_pair, expected):
    _check(_generate(*_models(tiny_pair)), expected, drafted=True)


def test_generate_json_in_process(tiny_pair, expected):
    _check(_generate(*_models(tiny_pair), "--in-process"), expected, drafted=True)


def test_generate_json_target_only(tiny_pair, expected):
    _check(_generate("--target", str(tiny_pair.target_dir), "--target-only"), expected, drafted=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # > 10 s here (measured): the full suite runs it, the quick tier does not
def test_serve_then_generate_against_it_then_sigterm(tiny_pair, expected):
    """`specdec serve` (subprocess) answers health, serves `generate --server`, and exits 0 on SIGTERM."""
    port = _free_port()
    env = dict(os.environ, SPECDEC_TARGET=str(tiny_pair.target_dir), SPECDEC_HOST="127.0.0.1",
               SPECDEC_PORT=str(port), SPECDEC_METRICS_PORT="0", SPECDEC_GRACE_PERIOD_S="2",
               OMP_WAIT_POLICY="PASSIVE")
    env.pop("SPECDEC_REDIS_URL", None)  # the in-process session store
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = check(address, timeout_s=2.0)
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
        assert status == "SERVING"
        assert check(address, service="", timeout_s=5.0) == "SERVING"
        _check(_generate("--server", address, "--draft", str(tiny_pair.draft_dir)), expected, drafted=True)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)  # the bound: exits on SIGTERM, no timing asserted beyond it
        assert proc.returncode == 0, out[-3000:]
        assert "shutting down" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    with pytest.raises(Exception):  # nothing listens any more
        check(address, timeout_s=1.0)


def test_generate_against_an_embedded_server(tiny_pair, expected):
    """--server HOST:PORT against an EmbeddedServer of this process (the same code path as a remote verifier)."""
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec.embedded import EmbeddedServer

    verifier = Verifier(TargetRunner(tiny_pair.target_dir))
    with EmbeddedServer(verifier=verifier, grace_s=1.0) as address:
        _check(_generate("--server", address, "--draft", str(tiny_pair.draft_dir)), expected, drafted=True)
        assert verifier.num_sessions == 0  # the CLI closed its session


def test_models_prepare_is_idempotent_on_the_prepared_cache():
    """On the prepared default cache `specdec models prepare` prints both paths and rewrites nothing (no
    re-export: every file's mtime unchanged)."""
    from specdec.models import default_model_paths, is_complete

    paths = default_model_paths()
    if not (is_complete(paths.target_dir) and is_complete(paths.draft_dir)):
        pytest.fail(f"the default cache is not prepared ({paths.target_dir}, {paths.draft_dir}): run "
                    "`specdec models prepare` first (CI does)")
    files = [p for d in (paths.target_dir, paths.draft_dir) for p in d.rglob("*") if p.is_file()]
    before = {p: p.stat().st_mtime_ns for p in files}
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "models", "prepare"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert f"target: {paths.target_dir}" in lines
    assert any(line.startswith("draft:") and line.split(":", 1)[1].strip() == str(paths.draft_dir) for line in lines)
    after = {p: p.stat().st_mtime_ns for d in (paths.target_dir, paths.draft_dir) for p in d.rglob("*") if p.is_file()}
    assert after == before  # no file rewritten, added or removed


def test_statistics_line_on_its_own_and_no_acceptance_without_drafting(tiny_pair):
    result = CliRunner().invoke(app, ["generate", PROMPT, "--max-new-tokens", "4", "--ignore-eos", "--target",
                                      str(tiny_pair.target_dir), "--target-only"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.endswith("\n")  # the text ends its line: the statistics are on their own
    stats = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 1 and "4 tokens" in stats[0] and "acceptance" not in stats[0], result.stderr
    assert "TTFT " in stats[0] and " tok/s decode" in stats[0], stats[0]  # the prefill apart from the decode speed
    assert "prefill:" not in result.stderr  # no status line where stderr is not a terminal
