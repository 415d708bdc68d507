"""`specdec edge-serve` (the OpenAI-compatible endpoint on the device) and `specdec serve` (a cloud verifier)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import typer

from specdec.cli._shared import (
    DEVICE_HELP, DTYPE_HELP, FALLBACK_HELP, SERVER_HELP, check_device, fail, quiet_transformers, user_errors,
    app,
)
from specdec.cli.checks import (
    check_device_names, check_port_free, check_readable, resolve_device_draft, resolve_draft_option,
)
from specdec.cli._shared import (
    DEFAULT_NUM_SPECULATIVE_TOKENS, ROUTE_HELP, DeviceDraftOption, DraftOption, NumSpeculativeTokens, check_route,
)
from specdec.cli.pipeline import build_edge_client, retry_policy


@app.command("edge-serve")
def edge_serve(
    host: str = typer.Option("127.0.0.1", help="Bind address of the HTTP endpoint"),
    port: int = typer.Option(8000, help="HTTP port"),
    server: Optional[str] = typer.Option(None, help=SERVER_HELP),
    fallback: str = typer.Option("none", help=FALLBACK_HELP),
    reconnect_interval_s: float = typer.Option(5.0, help="--fallback device: probe the cloud this often, s"),
    retry_budget_s: float = typer.Option(30.0, "--retry-budget-s", help="--server: how long a failed call goes on "
                                         "being retried on the next replica, s (cover a replica's restart)"),
    retry_max_attempts: int = typer.Option(8, "--retry-max-attempts", help="--server: tries of one call, the "
                                           "first one included"),
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
    num_speculative_tokens: NumSpeculativeTokens = DEFAULT_NUM_SPECULATIVE_TOKENS,
    target: Optional[Path] = typer.Option(None, help="Target HF directory (default: prepared SmolLM2)"),
    draft: DraftOption = None,
    device_draft: DeviceDraftOption = None,
    target_only: bool = typer.Option(False, "--target-only", help="Plain autoregressive decoding on the target"),
    device: str = typer.Option("auto", help=f"Target device of the embedded verifier: {DEVICE_HELP}"),
    dtype: str = typer.Option("auto", help=f"Target dtype of the embedded verifier: {DTYPE_HELP}"),
    insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback --host without an API key"),
    route: str = typer.Option("speculative", "--route", help="Default route of requests without a 'route' field: "
                              + ROUTE_HELP),
):
    """An OpenAI-compatible HTTP endpoint on the device (GET /v1/models, POST /v1/chat/completions and
    /v1/completions, streaming with server-sent events), backed by the local draft and the verifier (embedded
    when --server is not given). Binds 127.0.0.1 unless --host says otherwise; any other address needs
    --api-key (or --api-keys-file), or --insecure."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("specdec.edge_serve").setLevel(logging.INFO)  # one line per request (spec_metrics.py)
    check_route(route)
    from specdec_runtime.edge_client.transport.credentials import is_loopback_address

    if not is_loopback_address(f"[{host.strip('[]')}]:0") and not (api_key or api_keys_file) and not insecure:
        fail(f"--host {host} is not a loopback address: give --api-key (or --api-keys-file), or --insecure")
    if max_conversations < 0:
        fail(f"--max-conversations must be >= 0, got {max_conversations}")
    policy = retry_policy(retry_budget_s, retry_max_attempts)
    check_readable(api_keys_file, "--api-keys-file")
    check_readable(ca_cert, "--ca-cert")
    draft = resolve_draft_option(draft)  # a name (int8, distilled, head) or a directory: a directory from here on
    device_draft = resolve_device_draft(device_draft, target_only=target_only)
    check_port_free(host, port)  # before the models load: a used port is one line at once, not uvicorn's
    from specdec.openai_server import Engine, key_checker, serve as serve_http

    client, close = build_edge_client(
        target=target, draft=draft, server=server, fallback=fallback, reconnect_interval_s=reconnect_interval_s,
        tls=tls, ca_cert=ca_cert, api_key=verifier_api_key, target_only=target_only,
        num_speculative_tokens=num_speculative_tokens, device=device, dtype=dtype,
        retry_policy=policy, route=route, device_draft=device_draft,
        connect=False)  # the endpoint starts while the cloud is down: requests get 503 until it answers
    client.route = route  # edge_client.generation.routing; a request's 'route' field wins
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
    metrics_port: Optional[int] = typer.Option(
        None, help="Prometheus /metrics port, 0 = off (env SPECDEC_METRICS_PORT)"),
    device: Optional[str] = typer.Option(
        None, help=f"Target device: {DEVICE_HELP} (env SPECDEC_DEVICE; default auto)"),
    dtype: Optional[str] = typer.Option(None, help=f"Target weights and KV cache: {DTYPE_HELP} (env SPECDEC_DTYPE; "
                                        "default auto)"),
    tls_cert_file: Optional[str] = typer.Option(None, help="PEM certificate chain: TLS-only port (env "
                                                "SPECDEC_TLS_CERT_FILE)"),
    tls_key_file: Optional[str] = typer.Option(
        None, help="PEM private key of --tls-cert-file (env SPECDEC_TLS_KEY_FILE)"),
    tls_client_ca_file: Optional[str] = typer.Option(None, help="PEM CA of client certificates: mutual TLS (env "
                                                     "SPECDEC_TLS_CLIENT_CA_FILE)"),
    api_keys_file: Optional[str] = typer.Option(None, help="API-key hashes ('specdec keys create'): every call but "
                                                "health needs a key (env SPECDEC_API_KEYS_FILE)"),
    insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback --host without TLS and API keys "
                                  "(env SPECDEC_INSECURE=1)"),
    drafts_dir: Optional[str] = typer.Option(None, help="Drafts handed out to devices ('specdec draft publish'; env "
                                             "SPECDEC_DRAFTS_DIR)"),
    default_draft: Optional[str] = typer.Option(None, help="Draft name given to devices that name none (env "
                                                "SPECDEC_DEFAULT_DRAFT)"),
    tensor_parallel: Optional[int] = typer.Option(
        None, "--tensor-parallel", help="Shard the target over N ranks: N GPUs (NCCL) or N CPU processes (gloo), "
        "started by serve (or torchrun) (env SPECDEC_TENSOR_PARALLEL; default 1)"),
):
    """Run a cloud verifier (gRPC server; config also from SPECDEC_* environment variables).

    Binds 127.0.0.1 unless --host says otherwise; any other address needs TLS and API keys, or --insecure."""
    import asyncio

    from specdec.cli._shared import require_extra

    require_extra("verifier", "specdec serve")
    from specdec_runtime.cloud_verifier.config import VerifierSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {k: v for k, v in dict(host=host, port=port, redis_url=redis_url, target=target,
                                       metrics_port=metrics_port, device=device, dtype=dtype,
                                       tensor_parallel=tensor_parallel).items() if v is not None}
    overrides.update({k: v for k, v in dict(
        tls_cert_file=tls_cert_file, tls_key_file=tls_key_file, tls_client_ca_file=tls_client_ca_file,
        api_keys_file=api_keys_file, insecure=True if insecure else None, drafts_dir=drafts_dir,
        default_draft=default_draft).items() if v is not None})
    from pydantic import ValidationError

    try:
        settings = VerifierSettings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        fail(f"invalid setting {'.'.join(str(x) for x in err['loc'])}: {err['msg']} (got {err.get('input')!r})")
    if settings.metrics_port and settings.metrics_port == settings.port:
        fail(f"--metrics-port must differ from --port (both {settings.port})")
    # a torchrun rank > 0 of a tensor-parallel verifier binds nothing (rank 0 serves; it may have bound already)
    if not (settings.tensor_parallel > 1 and "WORLD_SIZE" in os.environ and int(os.environ.get("RANK", "0")) > 0):
        check_port_free(settings.host, settings.port, "--port")
        if settings.metrics_port:
            check_port_free(settings.host, settings.metrics_port, "--metrics-port")
    for flag, path in (("--tls-cert-file", settings.tls_cert_file), ("--tls-key-file", settings.tls_key_file),
                       ("--tls-client-ca-file", settings.tls_client_ca_file),
                       ("--api-keys-file", settings.api_keys_file)):
        check_readable(path, flag)
    check_device_names(settings.device, settings.dtype)
    check_device(settings.device, settings.dtype)  # before loading anything: no CUDA is one line
    quiet_transformers()  # after the checks: importing transformers takes a second
    from specdec_runtime.cloud_verifier.serving.server import serve as serve_async
    try:
        asyncio.run(serve_async(settings))
    except (*user_errors(), OSError, RuntimeError, ValueError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        pass
