"""`specdec generate`: one prompt, speculative decoding, committed text streamed to stdout."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from specdec_runtime.common.types import DEFAULT_DRAFT_TOP_K, SamplingParams, StoppingCriteria
from specdec.cli._shared import (
    DEFAULT_MIN_CONFIDENCE, DEVICE_HELP, DTYPE_HELP, check_device, explain, fail, user_errors, app,
)
from specdec.cli.checks import (
    check_device_names, check_head_on_device, check_logit_bias_vocabulary, check_min_tokens, check_model_dirs,
    check_num_speculative_tokens, check_prompt_fits, check_server, resolve_device_draft, resolve_draft_option,
)
from specdec.cli._shared import (
    DEFAULT_NUM_SPECULATIVE_TOKENS, ROUTE_HELP, DeviceDraftOption, DraftOption, NumSpeculativeTokens, check_route,
)
from specdec.cli.pipeline import build_pipeline, ensure_default_models
from specdec.cli.progress import PrefillStatus, timing_summary
from specdec.cli.grammar_flags import GRAMMAR, JSON_SCHEMA, REGEX, grammar_options
from specdec.cli.processing import (
    FREQUENCY_PENALTY, LOGIT_BIAS, LOGPROBS, MIN_P, MIN_TOKENS, PRESENCE_PENALTY, REPETITION_PENALTY, format_logprobs,
    processing_options,
)


def _check_generate_options(*, prompt, temperature, top_k, top_p, seed, max_new_tokens, stop, ignore_eos,
                            num_speculative_tokens, network_delay_ms, draft_top_k, min_confidence, server, device,
                            dtype, fallback, reconnect_interval_s, target_only, drafter, tls, ca_cert, api_key,
                            client_cert, client_key, target=None, draft=None, processing=None, raw=False,
                            route="speculative", device_draft=None):
    """The channel security of ``server`` (None without it), or exit with one line on a bad option: cheap checks
    first, a typo should not cost a model load (nor torch's import: the CUDA check comes last)."""
    if not prompt.strip():
        fail("empty prompt")
    check_server(server)
    from specdec_runtime.common.types import SamplingParams, StoppingCriteria

    try:
        SamplingParams(temperature, top_k, top_p, seed, **(processing or {})).validate()
        StoppingCriteria(max_new_tokens, (), tuple(stop), ignore_eos).validate()
    except ValueError as e:
        fail(str(e))
    check_num_speculative_tokens(num_speculative_tokens)
    check_min_tokens((processing or {}).get("min_tokens", 0), max_new_tokens)
    if network_delay_ms < 0:
        fail(f"--network-delay-ms must be >= 0, got {network_delay_ms}")
    if draft_top_k < 1:
        fail(f"--draft-top-k must be >= 1, got {draft_top_k}")
    if not 0.0 <= min_confidence < 1.0:
        fail(f"--min-confidence must be in [0, 1), got {min_confidence}")
    if not server:
        check_device_names(device, dtype)
    if fallback not in ("none", "device"):
        fail(f"--fallback must be 'none' or 'device', got {fallback!r}")
    if not reconnect_interval_s > 0:
        fail(f"--reconnect-interval-s must be > 0, got {reconnect_interval_s}")
    if fallback == "device" and (target_only or drafter != "model"):
        fail("--fallback device needs the draft model (not --target-only or --drafter ngram)")
    check_head_on_device(draft, route, fallback, device_draft)
    check_model_dirs(target, draft if drafter == "model" and not target_only else None)
    check_logit_bias_vocabulary(processing or {}, target, draft)
    if not server:
        if tls or ca_cert or client_cert or client_key:
            fail("--tls, --ca-cert, --client-cert and --client-key go with --server")
        check_prompt_fits(prompt, raw=raw, target=target, draft=draft)  # the context is known: count before loading
        check_device(device, dtype)  # the embedded verifier's target: no CUDA is one line, before any model loads
        return None
    from specdec_runtime.edge_client.transport.credentials import ChannelSecurity

    try:
        return ChannelSecurity.of(tls=tls, root_certificates=ca_cert, api_key=api_key,
                                  certificate_chain=client_cert, private_key=client_key)
    except ValueError as e:
        fail(str(e))


def _print_result(result, as_json: bool) -> None:
    """The end of a generation: a notice about unverified tokens, then the JSON object or a statistics line."""
    route = result.route or {}
    if not as_json:  # the text ends its line before anything comes on stderr (flushed: same order)
        sys.stdout.write("\n")
        sys.stdout.flush()
    if result.num_unverified_tokens:  # never pass the draft's tokens off as the target's
        why = "(--route device)" if route.get("requested") == "device" else "while no verifier answered"
        typer.echo(
            f"notice: {result.num_unverified_tokens} of {result.stats.num_generated_tokens} tokens were decoded on "
            f"the device by the draft model alone {why}: they are not verified by the target",
            err=True,
        )
    if as_json:
        typer.echo(json.dumps(result.to_json(), ensure_ascii=False))
        return
    s = result.stats
    # no acceptance without drafted tokens (--target-only, or a draft that proposed nothing)
    drafting = (f"acceptance {s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_length:.2f}, "
                if s.num_draft_tokens else "")
    if route.get("requested", "speculative") != "speculative":  # the route chosen and its switches
        drafting += (f"route {route['requested']}: {route['initial']}"
                     + "".join(f" -> {sw['to']}@{sw['at_token']}" for sw in route["switches"]) + ", ")
    finish = result.finish_reason.value if result.finish_reason else None
    typer.echo(f"[{timing_summary(s)}, {drafting}finish {finish}]", err=True)


# The connection options of `generate` (one group: the verifier's address, the fallback, the channel security),
# as module-level defaults so that the command's signature stays short.
SERVER = typer.Option(
    None, help="HOST:PORT of a running verifier, or several comma-separated (tried in order; a failed call "
    "moves to the next), or a load balancer (default: embedded)")
FALLBACK = typer.Option(
    "none", help="'none' or 'device': when no verifier answers, keep decoding with the draft alone "
    "(unverified tokens, counted and reported)")
RECONNECT_INTERVAL_S = typer.Option(5.0, help="--fallback device: probe the cloud this often, s")
TLS = typer.Option(False, "--tls", help="--server: TLS channel (system roots unless --ca-cert)")
CA_CERT = typer.Option(None, "--ca-cert", help="--server: PEM CA of the verifier's certificate (implies --tls)")
API_KEY = typer.Option(None, "--api-key", envvar="SPECDEC_API_KEY", show_envvar=True,
                       help="--server: API key (authorization: Bearer)")
CLIENT_CERT = typer.Option(None, "--client-cert", help="--server: PEM client certificate (mutual TLS, with "
                           "--client-key)")
CLIENT_KEY = typer.Option(None, "--client-key", help="--server: PEM key of --client-cert")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt (a user turn; see --raw)"),
    max_new_tokens: int = typer.Option(StoppingCriteria.max_new_tokens, "--max-new-tokens"),
    temperature: float = typer.Option(SamplingParams.temperature, help="0 = greedy"),
    top_k: int = typer.Option(SamplingParams.top_k, help="0 = off"),
    top_p: float = typer.Option(SamplingParams.top_p, help="1.0 = off; 0 = the most likely token only"),
    seed: Optional[int] = typer.Option(None, help="Seed of the session's random streams (sampling)"),
    num_speculative_tokens: NumSpeculativeTokens = DEFAULT_NUM_SPECULATIVE_TOKENS,
    draft_top_k: int = typer.Option(DEFAULT_DRAFT_TOP_K, help="k of top-k drafting for sampled sessions (1 = greedy "
                                    "drafting)"),
    drafter: str = typer.Option("model", help="'model' (ONNX draft) or 'ngram' (prompt lookup, no model)"),
    adaptive: bool = typer.Option(True, "--adaptive/--fixed-gamma", help="Choose γ per step (≤ -g) from measurements"),
    min_confidence: float = typer.Option(
        DEFAULT_MIN_CONFIDENCE, help="Stop a block when the draft's top prob < this (0 = off)"),
    proactive: bool = typer.Option(
        True, "--proactive/--no-proactive", help="Draft the next block while one is in flight"),
    network_delay_ms: float = typer.Option(0.0, help="Simulated one-way network delay, ms (testing)"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)"),
    ignore_eos: bool = typer.Option(False, help="Do not stop at EOS"),
    target: Optional[Path] = typer.Option(None, help="Target HF directory (default: prepared SmolLM2)"),
    draft: DraftOption = None,
    device_draft: DeviceDraftOption = None,
    server: Optional[str] = SERVER,
    fallback: str = FALLBACK,
    reconnect_interval_s: float = RECONNECT_INTERVAL_S,
    tls: bool = TLS,
    ca_cert: Optional[Path] = CA_CERT,
    api_key: Optional[str] = API_KEY,
    client_cert: Optional[Path] = CLIENT_CERT,
    client_key: Optional[Path] = CLIENT_KEY,
    in_process: bool = typer.Option(False, "--in-process", help="Call the verifier directly, without gRPC"),
    target_only: bool = typer.Option(False, "--target-only", help="Plain autoregressive decoding on the target"),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object at the end instead of streaming"),
    device: str = typer.Option("auto", help=f"Target device of the embedded verifier: {DEVICE_HELP}"),
    dtype: str = typer.Option("auto", help=f"Target dtype of the embedded verifier: {DTYPE_HELP}"),
    route: str = typer.Option("speculative", "--route", help=ROUTE_HELP),
    repetition_penalty: float = REPETITION_PENALTY,
    presence_penalty: float = PRESENCE_PENALTY,
    frequency_penalty: float = FREQUENCY_PENALTY,
    logit_bias: list[str] = LOGIT_BIAS,
    min_tokens: int = MIN_TOKENS,
    min_p: float = MIN_P,
    logprobs: Optional[int] = LOGPROBS,
    json_schema: Optional[Path] = JSON_SCHEMA,
    regex: Optional[str] = REGEX,
    grammar: Optional[Path] = GRAMMAR,
):
    """Generate text with speculative decoding, streaming committed text."""
    logging.basicConfig(level=logging.WARNING)
    check_route(route)
    processing = processing_options(
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logit_bias=logit_bias, min_tokens=min_tokens, min_p=min_p, logprobs=logprobs)
    processing.update(grammar_options(json_schema, regex, grammar))  # structured output
    draft = resolve_draft_option(draft)  # a name (int8, distilled, head) or a directory: a directory from here on
    device_draft = resolve_device_draft(device_draft, target_only=target_only, drafter=drafter)
    security = _check_generate_options(
        prompt=prompt, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_new_tokens=max_new_tokens,
        stop=stop, ignore_eos=ignore_eos, num_speculative_tokens=num_speculative_tokens,
        network_delay_ms=network_delay_ms, draft_top_k=draft_top_k, min_confidence=min_confidence, server=server,
        device=device, dtype=dtype, fallback=fallback, reconnect_interval_s=reconnect_interval_s,
        target_only=target_only, drafter=drafter, tls=tls, ca_cert=ca_cert, api_key=api_key,
        client_cert=client_cert, client_key=client_key, target=target, draft=draft, processing=processing, raw=raw,
        route=route, device_draft=device_draft)
    if ensure_default_models(target, draft, server=server, target_only=target_only, drafter=drafter) and not server:
        check_prompt_fits(prompt, raw=raw, target=target, draft=draft)  # first use: the tokenizer exists only now
    try:
        client, close = build_pipeline(
            target, draft, server=server, in_process=in_process, target_only=target_only,
            draft_top_k=draft_top_k, num_speculative_tokens=num_speculative_tokens, drafter=drafter,
            adaptive=adaptive, min_confidence=min_confidence, proactive=proactive, network_delay_ms=network_delay_ms,
            fallback=fallback, reconnect_interval_s=reconnect_interval_s, security=security,
            device=device, dtype=dtype, route=route, device_draft=device_draft)
    except user_errors() as e:
        fail(explain(e))
    client.route = route  # edge_client.generation.routing
    _stream(client, close, prompt, as_json, dict(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop=tuple(stop), ignore_eos=ignore_eos, chat=not raw, **processing))


def _stream(client, close, prompt: str, as_json: bool, kwargs: dict) -> None:
    """Generate ``prompt`` with ``kwargs``, the text to stdout as it is committed (not with ``as_json``), then the
    statistics (and with --logprobs one line per token) or the JSON object; ``close`` the pipeline after. A
    status line counts the prefill's seconds on a terminal until the first text comes."""
    from specdec_runtime.edge_client.request import encode_prompt

    status = PrefillStatus(len(encode_prompt(client.tokenizer, prompt, chat=kwargs.get("chat", True))))
    wrote = False
    try:
        with status:
            for delta in client.stream(prompt, **kwargs):
                status.stop()  # the first text ends the prefill's line
                if not as_json:
                    sys.stdout.write(delta)
                    sys.stdout.flush()
                    wrote = wrote or bool(delta)
        result = client.last_result
    except user_errors() as e:
        if wrote:  # the error's line starts on its own line, not after the text streamed so far
            sys.stdout.write("\n")
            sys.stdout.flush()
        fail(explain(e))
    finally:
        close()
    _print_result(result, as_json)
    if result.logprobs is not None and not as_json:  # --logprobs: one line per token after the statistics
        typer.echo("\n".join(format_logprobs(result, client.tokenizer)), err=True)
