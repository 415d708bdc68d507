"""What `specdec models export-head` and `specdec draft train-head` do with input they cannot use (tiny target,
tiny random EAGLE-3 checkpoints): a TARGET that is no causal LM, a --draft-vocab the --init-from checkpoint does
not have, too few sequences to hold any out, and Ctrl-C (a real SIGINT to a real process), each one line, nothing
half-made left in the output directory."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from _heads import write_eagle3
from specdec.cli import app

pytestmark = pytest.mark.timeout(300)

DRAFT_VOCAB = sorted(set(range(0, 49152, 61)) | set(range(200)))


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
