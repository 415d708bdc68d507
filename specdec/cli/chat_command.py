"""`specdec chat`: a multi-turn conversation in the terminal (one session kept across turns)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from specdec_runtime.common.types import SamplingParams, StoppingCriteria
from specdec.cli._shared import (
    DEVICE_HELP, DTYPE_HELP, FALLBACK_HELP, SERVER_HELP, explain, fail, user_errors, app,
)
from specdec.cli._shared import (
    DEFAULT_NUM_SPECULATIVE_TOKENS, ROUTE_HELP, DeviceDraftOption, DraftOption, NumSpeculativeTokens, check_route,
)
from specdec.cli.checks import (
    check_chat_input, check_logit_bias_vocabulary, check_min_tokens, check_num_speculative_tokens, check_prompt_fits,
    fail_no_chat_input, resolve_device_draft, resolve_draft_option,
)
from specdec.cli.grammar_flags import GRAMMAR, JSON_SCHEMA, REGEX, grammar_options
from specdec.cli.pipeline import build_edge_client
from specdec.cli.progress import PrefillStatus, timing_summary
from specdec.cli.processing import (
    FREQUENCY_PENALTY, LOGIT_BIAS, MIN_P, MIN_TOKENS, PRESENCE_PENALTY, REPETITION_PENALTY, processing_options,
)


def _stats_footer(result) -> str:
    """One line of statistics of a reply: tokens, time to first token, decode tokens/s, acceptance rate, mean
    accepted length."""
    s = result.stats
    rate = f"{s.acceptance_rate:.2f}" if s.num_draft_tokens else "n/a"
    line = f"[{timing_summary(s)}, acceptance {rate}, mean accepted length {s.mean_accepted_length:.2f}]"
    if result.num_unverified_tokens:
        line += f" ({result.num_unverified_tokens} tokens unverified: decoded by the draft alone)"
    return line


class _HistoryChat:
    """Stand-in for :class:`edge_client.conversation.Conversation` when it is not available: each turn is a new
    session over the whole history (rendered with :func:`specdec.openai_server.render_chat_ids`)."""

    def __init__(self, client, system: str | None):
        self.client, self.system = client, system
        self.last_result = None
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def send(self, message: str, **kw):
        from specdec.openai_server import render_chat_ids

        self.messages.append({"role": "user", "content": message})
        ids = render_chat_ids(self.client.tokenizer, self.messages)
        try:
            yield from self.client.stream_chunks(ids, **kw)
        except BaseException:
            self.messages.pop()
            raise
        self.last_result = self.client.last_result
        self.messages.append({"role": "assistant", "content": self.last_result.text})

    def close(self) -> None:
        fail(f"{refused} turn(s) refused (see above)")


def _reply(conv, message: str, kwargs: dict) -> None:
    """Stream one reply, then its statistics line on stderr; a refused request (e.g. the conversation outgrew the
    context) prints one line and keeps the conversation; so does Ctrl-C, which stops the reply (the turn is
    dropped, as an interrupted turn of :class:`edge_client.conversation.Conversation` is). Returns False when the
    turn was refused."""
    from specdec_runtime.common.errors import InvalidRequestError, UnsupportedByDrafterError

    chunks = conv.send(message, **kwargs)
    status = PrefillStatus()  # the turn's new tokens (a kept session prefills only those), on a terminal
    try:
        with status:
            for chunk in chunks:
                status.stop()
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C stops this reply only; the conversation goes on as it was before the turn
        chunks.close()
        sys.stdout.write("\n")
        sys.stdout.flush()
        typer.echo("[reply stopped: this turn is dropped, the conversation goes on; Ctrl-C again or Ctrl-D quits]",
                   err=True)
        return
    except UnsupportedByDrafterError as e:  # the chat's settings, not this turn (a delivered head on the device)
        sys.stdout.write("\n")
        sys.stdout.flush()
        fail(explain(e))  # every turn would be refused: the CLI's remedy, not /reset
    except InvalidRequestError as e:  # e.g. the conversation outgrew the context: start over
        typer.echo(f"\nerror: {e} (use /reset)", err=True)
        return False
    except user_errors() as e:
        sys.stdout.write("\n")  # the error's line starts on its own line, not after the reply's text so far
        sys.stdout.flush()
        fail(explain(e))
    sys.stdout.write("\n")
    sys.stdout.flush()
    typer.echo(_stats_footer(conv.last_result), err=True)
    return True


def _chat_loop(conv, kwargs: dict, interactive: bool) -> tuple[int, int]:
    """Read stdin line by line until /exit or end of input: commands (/reset, /exit) or messages. Returns the
    number of lines read and of turns refused."""
    lines = refused = 0
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        lines += 1
        message = line.rstrip("\r\n")
        command = message.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            conv.reset()
            typer.echo("[conversation reset]", err=True)
            continue
        if command.startswith("/") and " " not in command:
            typer.echo(f"unknown command {command} (/reset, /exit)", err=True)
            continue
        if _reply(conv, message, kwargs) is False:
            refused += 1
    return lines, refused


@app.command()
def chat(
    system: Optional[str] = typer.Option(None, help="System message of the conversation"),
    max_new_tokens: int = typer.Option(StoppingCriteria.max_new_tokens, "--max-new-tokens", help="Per reply"),
    temperature: float = typer.Option(SamplingParams.temperature, help="0 = greedy"),
    top_k: int = typer.Option(SamplingParams.top_k, help="0 = off"),
    top_p: float = typer.Option(SamplingParams.top_p, help="1.0 = off; 0 = the most likely token only"),
    seed: Optional[int] = typer.Option(None, help="Seed of each reply's random streams (sampling)"),
    num_speculative_tokens: NumSpeculativeTokens = DEFAULT_NUM_SPECULATIVE_TOKENS,
    server: Optional[str] = typer.Option(None, help=SERVER_HELP),
    fallback: str = typer.Option("none", help=FALLBACK_HELP),
    reconnect_interval_s: float = typer.Option(5.0, help="--fallback device: probe the cloud this often, s"),
    tls: bool = typer.Option(False, "--tls", help="--server: TLS channel (system roots unless --ca-cert)"),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help="--server: PEM CA of the verifier (implies --tls)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDEC_API_KEY", show_envvar=True,
                                          help="--server: API key of the verifier (authorization: Bearer)"),
    target: Optional[Path] = typer.Option(None, help="Target HF directory (default: prepared SmolLM2)"),
    draft: DraftOption = None,
    device_draft: DeviceDraftOption = None,
    target_only: bool = typer.Option(False, "--target-only", help="Plain autoregressive decoding on the target"),
    device: str = typer.Option("auto", help=f"Target device of the embedded verifier: {DEVICE_HELP}"),
    dtype: str = typer.Option("auto", help=f"Target dtype of the embedded verifier: {DTYPE_HELP}"),
    route: str = typer.Option("speculative", "--route", help=ROUTE_HELP),
    repetition_penalty: float = REPETITION_PENALTY,
    presence_penalty: float = PRESENCE_PENALTY,
    frequency_penalty: float = FREQUENCY_PENALTY,
    logit_bias: list[str] = LOGIT_BIAS,
    min_tokens: int = MIN_TOKENS,
    min_p: float = MIN_P,
    json_schema: Optional[Path] = JSON_SCHEMA,
    regex: Optional[str] = REGEX,
    grammar: Optional[Path] = GRAMMAR,
):
    """A multi-turn conversation in the terminal: type a message, the reply streams; `/reset` starts over,
    `/exit` (or end of input) quits. A statistics line (tokens/s, acceptance rate) follows each reply on stderr.

    The conversation keeps its sessions: each turn prefills only the new tokens. Reads stdin line by line, so
    it can be piped: `printf 'Hi\\n/reset\\nBye\\n' | specdec chat`. With --json-schema, --regex or --grammar
    every reply is constrained to it (docs/structured-output.md)."""
    logging.basicConfig(level=logging.WARNING)
    check_route(route)
    processing = processing_options(
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logit_bias=logit_bias, min_tokens=min_tokens, min_p=min_p, logprobs=None)
    processing.update(grammar_options(json_schema, regex, grammar))  # structured output: every reply
    try:
        SamplingParams(temperature, top_k, top_p, seed, **processing).validate()
        StoppingCriteria(max_new_tokens, (), (), False).validate()
    except ValueError as e:
        fail(str(e))
    check_min_tokens(min_tokens, max_new_tokens)
    check_num_speculative_tokens(num_speculative_tokens)
    draft = resolve_draft_option(draft)  # a name (int8, distilled, head) or a directory: a directory from here on
    device_draft = resolve_device_draft(device_draft, target_only=target_only)
    check_logit_bias_vocabulary(processing, target, draft)
    if system and not server:  # the one prompt known at start: a system message no context holds
        check_prompt_fits([{"role": "system", "content": system}], raw=False, target=target, draft=draft)
    client, close = build_edge_client(
        target=target, draft=draft, server=server, fallback=fallback, reconnect_interval_s=reconnect_interval_s,
        tls=tls, ca_cert=ca_cert, api_key=api_key, target_only=target_only,
        num_speculative_tokens=num_speculative_tokens, device=device, dtype=dtype, route=route,
        device_draft=device_draft, before_load=check_chat_input)  # nothing to read: said before the models load
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                  **processing)
    client.route = route  # edge_client.generation.routing
    interactive = sys.stdin.isatty()
    conv = client.chat(system=system) if hasattr(client, "chat") else _HistoryChat(client, system)
    if interactive:
        typer.echo("specdec chat: /reset starts a new conversation, /exit quits", err=True)
    lines = refused = 0
    try:
        lines, refused = _chat_loop(conv, kwargs, interactive)
    except KeyboardInterrupt:
        lines = -1
    finally:
        conv.close()
        close()
    if lines == 0 and not interactive:  # a pipe that closed without a line: nothing was asked
        fail_no_chat_input()
    if refused and not interactive:  # a script reading a pipe's output must learn that a turn got no reply
        fail(f"{refused} turn(s) refused (see above)")
