"""The processing flags through the CLI in a subprocess: a bad value is one ``error:`` line naming the field,
before any model loads; `generate --json` with every flag (tiny pair, embedded verifier) equals `--target-only`
with the same flags, and `--logprobs N` puts N alternatives per token in the JSON."""

from __future__ import annotations

import json

import pytest

from test_cli_errors import _one_error, _specdec  # noqa: E402 - the CLI-in-a-subprocess helpers

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("command, flags, expected", [
    ("generate", ["--presence-penalty", "2.5"], "presence_penalty must be in [-2, 2]"),
    ("generate", ["--frequency-penalty", "-3"], "frequency_penalty must be in [-2, 2]"),
    ("generate", ["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    ("generate", ["--logit-bias", "5=101"], "logit_bias bias of token 5 must be in [-100, 100]"),
    ("generate", ["--logit-bias", "x=1"], "--logit-bias takes ID=BIAS"),
    ("generate", ["--min-tokens", "-1"], "min_tokens must be >= 0"),
    ("generate", ["--min-p", "1.5"], "min_p must be in [0, 1]"),
    ("generate", ["--logprobs", "21"], "top_logprobs must be in [0, 20]"),
    ("chat", ["--presence-penalty", "2.5"], "presence_penalty must be in [-2, 2]"),
    ("chat", ["--logit-bias", "7"], "--logit-bias takes ID=BIAS"),
    ("bench", ["--repetition-penalty", "-1"], "repetition_penalty must be > 0"),
    ("bench", ["--min-p", "2"], "min_p must be in [0, 1]"),
])
def test_bad_values_are_one_line_naming_the_field(command, flags, expected):
    args = [command, *flags] + (["hi"] if command == "generate" else [])
    _one_error(args, expected)  # before any model runtime is imported


@pytest.mark.slow  # > 10 s here (measured): the full suite runs it, the quick tier does not
def test_generate_json_equals_target_only_with_every_flag(tiny_pair):
    flags = ["--logit-bias", "100=6", "--logit-bias", "200=5.5", "--logit-bias", "300=5", "--presence-penalty", "1",
             "--frequency-penalty", "0.4", "--repetition-penalty", "1.2", "--min-tokens", "2", "--logprobs", "3"]
    common = ["generate", "Why is the sky blue?", "--target", str(tiny_pair.target_dir), "--draft",
              str(tiny_pair.draft_dir), "--max-new-tokens", "12", "--ignore-eos", "--json", "--device", "cpu", *flags]
    outs = []
    for extra in ([], ["--target-only"]):
        rc, out, err, _ = _specdec(*common, *extra, timeout=240)
        assert rc == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    spec, target = outs
    assert spec["token_ids"] == target["token_ids"] and spec["num_draft_tokens"] > 0
    assert len(spec["logprobs"]) == 12 and all(len(e["top_logprobs"]) == 3 for e in spec["logprobs"])
    for a, b in zip(spec["logprobs"], target["logprobs"]):
        assert abs(a["logprob"] - b["logprob"]) < 1e-4
