"""What `specdec models export-head` and `specdec draft train-head` do with input they cannot use (tiny target,
tiny random EAGLE-3 checkpoints): a TARGET that is no causal LM, a --draft-vocab the --init-from checkpoint does
not have, too few sequences to hold any out, and Ctrl-C (a real SIGINT to a real process), each one line, nothing
half-made left in the output directory."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _heads import write_eagle3
from specdec.cli import app

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
DRAFT_VOCAB = sorted(set(range(0, 49152, 61)) | set(range(200)))
TEXTS = ["The sky is blue because of Rayleigh scattering.", "Write a haiku about the sea.",
         "List three prime numbers and explain why.", "How do I boil an egg?"]


def _prompts(path: Path, texts=TEXTS) -> Path:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def _one_line(result, needle: str) -> str:
    assert result.exit_code == 2, (result.output, result.stderr)
    err = result.stderr.strip()
    assert err.startswith("error:") and needle in err and "\n" not in err, err
    return err


def test_export_head_with_a_target_that_is_no_causal_lm_is_one_line(tiny_pair, tmp_path):
    """The arguments swapped (a head checkpoint as TARGET), and a model directory transformers cannot load (no
    model_type), each one line and no OUT left behind; the right order converts."""
    ckpt = write_eagle3(tmp_path / "ckpt", tiny_pair.target_dir, DRAFT_VOCAB)
    shutil.copy(tiny_pair.target_dir / "tokenizer.json", ckpt / "tokenizer.json")  # it looks like a model dir
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny_pair.target_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    config.pop("model_type")
    config["architectures"] = ["NoSuchModel"]
    (unknown / "config.json").write_text(json.dumps(config))
    runner = CliRunner()
    for target, needle in ((ckpt, "is a draft head checkpoint, not the target model"),
                           (unknown, "not a causal LM transformers can load")):
        out = tmp_path / f"out-{target.name}"
        result = runner.invoke(app, ["models", "export-head", str(target), str(ckpt), str(out)])
        _one_line(result, needle)
        assert "Traceback" not in result.output and not out.exists()
    result = runner.invoke(app, ["models", "export-head", str(tiny_pair.target_dir), str(ckpt), str(tmp_path / "ok")])
    assert result.exit_code == 0, (result.output, result.stderr)
    assert (tmp_path / "ok" / "head.json").is_file()


def test_a_draft_vocab_the_checkpoint_does_not_have_is_refused_before_any_data(tiny_pair, tmp_path, monkeypatch):
    from specdec.distill.head_training import check_checkpoint

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = write_eagle3(tmp_path / "ckpt", tiny_pair.target_dir, DRAFT_VOCAB)
    n = len(DRAFT_VOCAB)
    assert check_checkpoint(ckpt) == n and check_checkpoint(ckpt, n) == n  # left out, or the checkpoint's own
    with pytest.raises(ValueError, match=f"--draft-vocab {n + 1} disagrees"):
        check_checkpoint(ckpt, n + 1)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["draft", "train-head", str(out), "--train-prompts", str(_prompts(tmp_path / "p")),
                                      "--target", str(tiny_pair.target_dir), "--init-from", str(ckpt),
                                      "--draft-vocab", "8192"])
    err = _one_line(result, f"whose draft vocabulary is {n} tokens")
    assert "answers:" not in result.output and "--draft-vocab 8192" in err
    assert not out.exists() and not (tmp_path / "cache" / "head-data").exists()  # no data work began


@pytest.mark.parametrize("n,fraction,held", [(2, 0.03, 0), (33, 0.03, 0), (34, 0.03, 1), (100, 0.03, 3),
                                             (100, 0.29, 29), (50, 0.0, 0), (2, 0.5, 1), (1, 0.5, 0)])
def test_sequences_are_held_out_only_from_one_over_the_fraction_on(n, fraction, held):
    from specdec.distill.head_training import _split_heldout

    train, heldout = _split_heldout(list(range(n)), fraction)
    assert len(heldout) == held and sorted(train + heldout) == list(range(n))


def test_two_sequences_all_train_and_the_heldout_agreement_is_absent(tiny_pair, tmp_path, monkeypatch):
    from specdec.distill.head_training import train_head

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    lines = []
    result = train_head(tiny_pair.target_dir, _prompts(tmp_path / "p", TEXTS[:2]), tmp_path / "ckpt", num_prompts=2,
                        max_prompt_tokens=64, max_new_tokens=8, draft_vocab=256, epochs=1, ttt_steps=2,
                        progress=lines.append)
    report = json.loads((tmp_path / "ckpt" / "training.json").read_text())
    assert (report["sequences"], report["heldout_sequences"]) == (2, 0)
    assert result["curve"][0]["heldout_top1_per_step"] is None
    assert report["curve"][0]["heldout_top1_per_step"] is None
    assert any(line.startswith("epoch 1/1:") and "(none held out)" in line for line in lines), lines


def _interrupt_training(tiny_pair, tmp_path: Path, out: Path) -> tuple[int, list[str]]:
    """Run `draft train-head` (endless epochs) in a real process, send SIGINT once it prints its data line
    (training has begun), and return (exit status, stderr lines)."""
    env = dict(os.environ, SPECDEC_CACHE_DIR=str(tmp_path / "cache"), OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "draft", "train-head", str(out), "--train-prompts",
         str(_prompts(tmp_path / "p")), "--target", str(tiny_pair.target_dir), "--num-prompts", "4",
         "--max-prompt-tokens", "64", "--max-new-tokens", "8", "--draft-vocab", "256", "--epochs", "1000000"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # a test run started as a background job of a non-interactive shell ignores SIGINT and the child would
        # inherit that (no KeyboardInterrupt ever): SIGINT as a terminal delivers it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in proc.stderr], daemon=True)
    reader.start()
    seen = []
    try:
        while not any(line.startswith("data:") for line in seen):
            seen.append(lines.get(timeout=240))  # bounded: a run that never gets there fails here
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    while not lines.empty():
        seen.append(lines.get())
    return code, seen


def test_ctrl_c_leaves_no_output_directory_behind(tiny_pair, tmp_path):
    """SIGINT during training: exit 130 and one line; an OUT_DIR this run made is gone, one that was there
    before (empty) is kept as it was; the next run may use either."""
    for out, made in ((tmp_path / "new-out", True), (tmp_path / "old-out", False)):
        if not made:
            out.mkdir()
        code, lines = _interrupt_training(tiny_pair, tmp_path, out)
        assert code == 130, lines
        assert lines[-1].startswith("error: interrupted: ") and str(out) in lines[-1], lines
        assert not any("Traceback" in line or "Aborted" in line for line in lines), lines
        if made:
            assert not out.exists()
        else:
            assert out.is_dir() and not any(out.iterdir())


@pytest.mark.parametrize("content, needle", [
    ('{"text": "x"}\n', ':1: no "prompt" text'),
    ('{"prompt": "ok"}\nnot json\n', ":2: not JSON"),
    ("\n", "no prompts"),
])
def test_a_prompts_file_without_prompts_is_one_line_before_anything_loads(tiny_pair, tmp_path, content, needle):
    """A training prompts file that is not JSONL of {"prompt": ...}: one line naming the file and line, exit 2,
    before the target loads (no "device:" line) and with no OUT_DIR made."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["draft", "train-head", str(out), "--train-prompts", str(prompts),
                                      "--target", str(tiny_pair.target_dir)])
    line = _one_line(result, needle)
    assert str(prompts) in line and "device:" not in result.output, result.output
    assert not out.exists()
