"""The edge as an edge install runs it (``specdec-edgecloud[edge]``: no torch, no transformers, no cloud_verifier): the CLI
and the SDK in a subprocess where those modules cannot be imported (tests/_edge_only.py), against a verifier of
this process, greedy-identical to target-only decoding; sampled decoding runs too (numpy's exp on the edge).

``SPECDEC_SLOW_INSTALL_TEST=1`` also installs ``.[edge]`` into a fresh venv from the package index (minutes) and
checks that neither torch nor transformers gets installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _reference import hf_greedy
from specdec_runtime.edge_client.request import encode_prompt

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PROMPT = "Name three colors."
MAX_NEW = 12
# run in the child: block the non-edge packages, run the code, then report what got imported
_PRELUDE = "import _edge_only, sys, json, atexit\n" \
           "atexit.register(lambda: print('MODULES ' + json.dumps(sorted(_edge_only.root(m) for m in sys.modules)), " \
           "file=sys.stderr))\n"


def _run_edge(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    modules = set(json.loads(proc.stderr.rsplit("MODULES ", 1)[1]))
    assert not modules & {"torch", "transformers", "cloud_verifier"}, modules
    return proc


@pytest.fixture(scope="module")
def verifier_address(tiny_pair):
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec.embedded import EmbeddedServer

    with EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir)), grace_s=1.0) as address:
        yield address


@pytest.fixture(scope="module")
def expected(tiny_pair):
    from transformers import AutoTokenizer

    return hf_greedy(tiny_pair.target_dir, encode_prompt(AutoTokenizer.from_pretrained(tiny_pair.target_dir),
                                                         PROMPT), MAX_NEW)


def _cli(address, draft_dir, *args) -> dict:
    argv = ["specdec", "generate", PROMPT, "--server", address, "--draft", str(draft_dir), "--json",
            "--max-new-tokens", str(MAX_NEW), "--ignore-eos", *args]
    proc = _run_edge(f"sys.argv = {argv!r}\nfrom specdec.cli import app\napp()")
    return json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])


def test_cli_generate_edge_only_is_greedy_identical(tiny_pair, verifier_address, expected):
    out = _cli(verifier_address, tiny_pair.draft_dir)
    assert out["token_ids"] == expected
    assert out["num_draft_tokens"] > 0 and out["acceptance_rate"] > 0.5  # the draft did draft


def test_cli_generate_edge_only_sampled(tiny_pair, verifier_address):
    # the tiny random draft is never confident: no confidence truncation, or it drafts nothing
    args = ("--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--min-confidence", "0", "--fixed-gamma")
    a = _cli(verifier_address, tiny_pair.draft_dir, *args)
    b = _cli(verifier_address, tiny_pair.draft_dir, *args)
    assert a["num_generated_tokens"] == MAX_NEW and a["num_draft_tokens"] > 0
    assert a["token_ids"] == b["token_ids"]  # seeded: reproducible


def test_sdk_edge_only_is_greedy_identical(tiny_pair, verifier_address, expected):
    code = textwrap.dedent(f"""
        from specdec import EdgeClient  # the front door, as an app developer writes it
        with EdgeClient.connect({verifier_address!r}, {str(tiny_pair.draft_dir)!r}) as client:
            text = "".join(client.stream({PROMPT!r}, max_new_tokens={MAX_NEW}, ignore_eos=True))
            print(json.dumps({{"ids": client.last_result.token_ids, "text": text}}))
    """)
    out = json.loads(_run_edge(code).stdout.strip().splitlines()[-1])
    assert out["ids"] == expected and out["text"]


def test_blocker_blocks():
    proc = subprocess.run([sys.executable, "-c", "import _edge_only\nimport torch"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(TESTS)}, timeout=60)
    assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr


@pytest.mark.skipif(os.environ.get("SPECDEC_SLOW_INSTALL_TEST") != "1",
                    reason="SPECDEC_SLOW_INSTALL_TEST=1 not set: a fresh-venv install of .[edge] from the index")
def test_fresh_venv_edge_install_has_no_torch(tmp_path):
    venv = tmp_path / "edge-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", f"{ROOT}[edge]"], check=True, timeout=1800)
    listed = subprocess.run([*pip, "list", "--format=freeze"], check=True, capture_output=True, text=True).stdout
    names = {line.split("==")[0].lower() for line in listed.splitlines()}
    assert not names & {"torch", "transformers"}, names
    assert {"onnxruntime", "tokenizers", "grpcio", "jinja2"} <= names
    help_ = subprocess.run([str(venv / "bin" / "specdec"), "--help"], capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "generate" in help_.stdout


def test_edge_serve_edge_only(tiny_pair, verifier_address):
    """`specdec edge-serve` (OpenAI-compatible endpoint) with the verifier/tools packages blocked."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["specdec", "edge-serve", "--port", str(port), "--server", verifier_address, "--draft",
            str(tiny_pair.draft_dir), "--model-name", "m"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    code = _PRELUDE + f"sys.argv = {argv!r}\nfrom specdec.cli import app\napp()"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # the endpoint announces itself once it listens
            if "edge endpoint:" in line:
                break
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
