"""One set of generation defaults: the SDK (generation_params, hence EdgeClient.stream_chunks and Conversation),
the CLI (`specdec generate` / `chat`) and edge-serve (max_tokens when a request gives none) all take them from the
parameter types themselves (common.types.SamplingParams / StoppingCriteria)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

from specdec_runtime.common.types import SamplingParams, StoppingCriteria
from specdec_runtime.edge_client.request import generation_params
from specdec.openai_server.request import DEFAULT_MAX_TOKENS


def test_sdk_defaults_are_the_parameter_types_defaults():
    sampling, stopping = generation_params()
    assert sampling == SamplingParams()
    assert stopping == StoppingCriteria()


def test_edge_serve_max_tokens_default_is_the_sdks():
    assert DEFAULT_MAX_TOKENS == StoppingCriteria().max_new_tokens


def test_cli_defaults_are_the_sdks():
    for command in ("generate", "chat"):
        out = subprocess.run([sys.executable, "-m", "specdec.cli", command, "--help"], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
        # an option's help may wrap: its default is the first one before the next option
        found = {name: re.search(rf"--{name}\s+<\w+>(?:(?!\n\s+--).)*?\[default: ([^\]]+)\]", out, re.S)
                 for name in ("max-new-tokens", "temperature", "top-k", "top-p")}
        assert all(found.values()), (command, out)
        assert int(found["max-new-tokens"].group(1)) == StoppingCriteria().max_new_tokens
        assert float(found["temperature"].group(1)) == SamplingParams().temperature
        assert int(found["top-k"].group(1)) == SamplingParams().top_k
        assert float(found["top-p"].group(1)) == SamplingParams().top_p


def test_sdk_signature_defaults_name_no_literal_of_their_own():
    params = inspect.signature(generation_params).parameters
    assert params["max_new_tokens"].default == StoppingCriteria.max_new_tokens
    assert params["temperature"].default == SamplingParams.temperature
