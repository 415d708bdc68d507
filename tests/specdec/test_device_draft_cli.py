"""`--device-draft` (generate, chat, edge-serve): a standalone draft that decodes on the device beside a draft head
(tiny target, a tiny random EAGLE-3 head, the tiny pair's second ONNX draft as the device draft; real embedded
verifier over gRPC, or a --server nobody listens on). What the device decodes is unverified, so it is compared with
what the device draft alone decodes (`--draft DEVICE_DRAFT` on the same route), not with the target."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from _heads import write_eagle3
from _reference import hf_greedy
from specdec.cli import app

pytestmark = pytest.mark.timeout(300)

PROMPT = "Name three colors."
MAX_NEW = 10


@pytest.fixture(scope="module")
def head_dir(tiny_pair, tmp_path_factory):
    from specdec.models.head_export import export_head

    root = tmp_path_factory.mktemp("device-draft-head")
    ckpt = write_eagle3(root / "ckpt", tiny_pair.target_dir, sorted(set(range(0, 49152, 61)) | set(range(200))))
    return export_head(tiny_pair.target_dir, ckpt, root / "head")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate(*args: str) -> dict:
    result = CliRunner().invoke(app, ["generate", PROMPT, "--json", "--max-new-tokens", str(MAX_NEW), "--ignore-eos",
                                      *args])
    assert result.exit_code == 0, (result.output, result.stderr)
    return json.loads([line for line in result.stdout.splitlines() if line.strip()][-1])


def _one_line_error(result, needle: str) -> str:
    assert result.exit_code == 2, (result.output, result.stderr)
    err = result.stderr.strip()
    assert err.startswith("error:") and needle in err and "\n" not in err, err
    return err


def test_route_device_beside_a_head_decodes_with_the_device_draft(tiny_pair, head_dir):
    from transformers import AutoTokenizer

    from specdec_runtime.edge_client.client import encode_prompt

    target = ["--target", str(tiny_pair.target_dir)]
    device_alone = _generate(*target, "--draft", str(tiny_pair.other_draft_dir), "--route", "device")
    beside = _generate(*target, "--draft", str(head_dir), "--device-draft", str(tiny_pair.other_draft_dir),
                       "--route", "device")
    assert beside["num_unverified_tokens"] == MAX_NEW and len(beside["token_ids"]) == MAX_NEW
    assert beside["token_ids"] == device_alone["token_ids"]
    # the device draft is not the target (a second random model): its unverified tokens are its own
    tok = AutoTokenizer.from_pretrained(tiny_pair.target_dir)
    assert beside["token_ids"] != hf_greedy(tiny_pair.target_dir, encode_prompt(tok, PROMPT), MAX_NEW)
    # beside another draft, the device decodes with --device-draft instead of --draft
    instead = _generate(*target, "--draft", str(tiny_pair.draft_dir), "--device-draft",
                        str(tiny_pair.other_draft_dir), "--route", "device")
    assert instead["token_ids"] == device_alone["token_ids"]


def test_fallback_device_beside_a_head_when_no_verifier_answers(tiny_pair, head_dir):
    server = ["--server", f"127.0.0.1:{_free_port()}", "--fallback", "device", "--reconnect-interval-s", "30"]
    device_alone = _generate(*server, "--draft", str(tiny_pair.other_draft_dir))
    beside = _generate(*server, "--draft", str(head_dir), "--device-draft", str(tiny_pair.other_draft_dir))
    assert beside["num_unverified_tokens"] == MAX_NEW and device_alone["num_unverified_tokens"] == MAX_NEW
    assert beside["token_ids"] == device_alone["token_ids"]


def test_chat_route_device_beside_a_head(tiny_pair, head_dir):
    """chat (and edge-serve: the same build_edge_client) pass --device-draft to the client (a real subprocess:
    chat reads its pipe)."""
    def reply(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--max-new-tokens", "6", "--route",
                               "device", "--target", str(tiny_pair.target_dir), *args],
                              input="Hello there\n", capture_output=True, text=True, timeout=250)
        assert proc.returncode == 0 and "6 tokens unverified" in proc.stderr, proc.stderr
        return proc.stdout

    alone = reply("--draft", str(tiny_pair.other_draft_dir))
    assert alone.strip() and reply("--draft", str(head_dir), "--device-draft", str(tiny_pair.other_draft_dir)) == alone


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["edge-serve", "--port", "0"]])
def test_a_head_or_no_draft_model_with_device_draft_is_one_line(tiny_pair, head_dir, command):
    runner = CliRunner()
    err = _one_line_error(runner.invoke(app, [*command, "--device-draft", str(head_dir), "--route", "device"],
                                        input=""), f"--device-draft {head_dir} is a draft head")
    assert "cannot decode alone" in err and "int8, distilled or an ONNX draft directory" in err, err
    _one_line_error(runner.invoke(app, [*command, "--device-draft", str(tiny_pair.other_draft_dir), "--target-only"],
                                  input=""), "--device-draft goes with a draft model")
    _one_line_error(runner.invoke(app, [*command, "--device-draft", "nope"], input=""),
                    "--device-draft: unknown draft 'nope'")


def test_a_device_draft_of_another_vocabulary_is_one_line(tiny_pair, head_dir, tmp_path):
    """The device draft's tokens are decoded with the client's tokenizer: one token more in its vocabulary is
    refused before anything is generated, naming the flag."""
    import shutil

    from transformers import AutoTokenizer

    other = shutil.copytree(tiny_pair.other_draft_dir, tmp_path / "one-token-more")
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<device_only_token>"])
    tok.save_pretrained(other)
    result = CliRunner().invoke(app, ["generate", PROMPT, "--target", str(tiny_pair.target_dir), "--draft",
                                      str(head_dir), "--device-draft", str(other), "--route", "device"])
    _one_line_error(result, f"--device-draft {other}: draft and target vocabularies differ at token id 49152")


def test_edge_serve_a_request_for_route_device_beside_a_head(tiny_pair, head_dir):
    """edge-serve (a real subprocess, the official openai client): with --device-draft, a request's route device
    is served beside the head (200, unverified) with the device draft's own tokens, where a head alone is a 400."""
    import openai

    from test_openai_server import _edge_serve

    def device_reply(*args: str) -> tuple[str, dict]:
        with _edge_serve("--target", str(tiny_pair.target_dir), "--model-name", "tiny", *args) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=MAX_NEW, temperature=0, extra_body={"route": "device"})
        return r.choices[0].message.content, r.model_extra["specdec"]

    alone, alone_stats = device_reply("--draft", str(tiny_pair.other_draft_dir))
    beside, stats = device_reply("--draft", str(head_dir), "--device-draft", str(tiny_pair.other_draft_dir))
    assert stats["num_unverified_tokens"] == alone_stats["num_unverified_tokens"] > 0, stats
    assert alone and beside == alone


def test_a_delivered_head_with_a_device_draft_decodes_on_the_device(tiny_pair, head_dir, tmp_path, monkeypatch):
    """generate --server with no draft here fetches the verifier's draft (a head, published like a draft); with
    --device-draft, route device decodes with that draft beside the delivered head."""
    from specdec.embedded import EmbeddedServer
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, publish_draft
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    publish_draft(head_dir, tmp_path / "drafts", "head", "1")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "empty-cache"))  # no default draft: delivery
    catalog = DraftCatalog(tmp_path / "drafts", rescan_interval_s=0.0)
    with EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir)), grace_s=1.0,
                        drafts=catalog) as address:
        server = ["--server", address, "--route", "device"]
        alone = _generate(*server, "--draft", str(tiny_pair.other_draft_dir))
        result = CliRunner().invoke(app, ["generate", PROMPT, "--json", "--max-new-tokens", str(MAX_NEW),
                                          "--ignore-eos", *server, "--device-draft", str(tiny_pair.other_draft_dir)])
    assert result.exit_code == 0, (result.output, result.stderr)
    assert "draft: head@1 from the verifier, fetched" in result.stderr, result.stderr  # the head came
    beside = json.loads([line for line in result.stdout.splitlines() if line.strip()][-1])
    assert beside["num_unverified_tokens"] == MAX_NEW and beside["token_ids"] == alone["token_ids"]


def test_chat_with_a_delivered_head_on_the_device_names_device_draft(tiny_pair, head_dir, tmp_path):
    """Without --device-draft, chat's turn with a delivered head on route device is refused by the drafter
    contract: one line with the CLI's remedy (--device-draft), not the SDK's, nor '/reset' (no turn would do)."""
    import os

    from specdec.embedded import EmbeddedServer
    from specdec_runtime.cloud_verifier.drafts.catalog import DraftCatalog, publish_draft
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier

    publish_draft(head_dir, tmp_path / "drafts", "head", "1")
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(tmp_path / "empty-cache")}  # no default draft: delivery
    with EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir)), grace_s=1.0,
                        drafts=DraftCatalog(tmp_path / "drafts", rescan_interval_s=0.0)) as address:
        proc = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--server", address, "--route", "device",
                               "--max-new-tokens", "4"], input="Hello\nAgain\n", capture_output=True, text=True,
                              timeout=250, env=env)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: --route device needs a draft that decodes alone;"), errors
    assert "give --device-draft a draft that decodes alone" in errors[0] and "EdgeClient" not in proc.stderr, errors
    assert "/reset" not in proc.stderr, proc.stderr
