"""`specdec chat`: a multi-turn terminal conversation, driven through a pipe (a real subprocess, the embedded
verifier, the default prepared SmolLM2 pair). Greedy replies are compared with target-only decoding over the
chat-templated history."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

MAX_NEW = 40
Q1 = "What is 2 + 2? Answer with one short sentence."
Q2 = "And 3 + 3?"


def _chat(stdin: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--max-new-tokens", str(MAX_NEW), *args],
                          input=stdin, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def target_only(real_pair):
    """Target-only greedy decoding over the chat-templated messages: messages → reply text."""
    from specdec_runtime.common.chat import render_chat_ids
    from specdec.cli import build_pipeline

    edge, close = build_pipeline(None, None, server=None, in_process=True, target_only=True, draft_top_k=1,
                                 num_speculative_tokens=1)

    def run(messages):
        ids = render_chat_ids(edge.tokenizer, messages)
        return edge.generate(ids, max_new_tokens=MAX_NEW, temperature=0.0).text

    yield run
    close()


def test_chat_two_turns_then_reset(target_only):
    """Two turns (the second sees the first), /reset, the second question again (now without the first: a fresh
    conversation), /exit (lines after it are not read)."""
    out = _chat(f"{Q1}\n{Q2}\n/reset\n{Q2}\n/exit\n{Q1}\n")
    reply1 = target_only([{"role": "user", "content": Q1}])
    reply2 = target_only([{"role": "user", "content": Q1}, {"role": "assistant", "content": reply1},
                          {"role": "user", "content": Q2}])
    alone = target_only([{"role": "user", "content": Q2}])
    assert len({reply1, reply2, alone}) == 3  # the context matters: a /reset that keeps it would show
    assert out.stdout == f"{reply1}\n{reply2}\n{alone}\n"
    footers = [line for line in out.stderr.splitlines() if "tok/s" in line]
    assert len(footers) == 3 and all("acceptance" in line for line in footers), out.stderr
    assert "[conversation reset]" in out.stderr


def test_chat_unknown_command_and_system(target_only):
    system = "You are a terse assistant."
    out = _chat(f"/frobnicate\n{Q1}\n", "--system", system)
    assert "unknown command /frobnicate" in out.stderr
    assert out.stdout == target_only([{"role": "system", "content": system}, {"role": "user", "content": Q1}]) + "\n"


def test_a_piped_turn_that_is_refused_fails_the_run_but_not_the_conversation(target_only):
    """A message longer than the context is refused (one line) and the next one is answered as if it had not
    been sent; a pipe's run then ends with status 2 and says how many turns were refused, so that a script
    reading only stdout learns that a reply is missing."""
    too_long = "word " * 10000  # past SmolLM2's 8,192-token context
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--max-new-tokens", str(MAX_NEW)],
                          input=f"{too_long}\n{Q1}\n", capture_output=True, text=True, timeout=500)
    assert proc.returncode == 2, proc.stderr
    assert "1 turn(s) refused" in proc.stderr
    assert proc.stdout.endswith(target_only([{"role": "user", "content": Q1}]) + "\n")
