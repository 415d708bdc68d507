"""Argument checks every command runs before it loads anything (torch, a model, a port): each failure is one
``error: ...`` line and exit status 2, within a fraction of a second."""

from __future__ import annotations

import os
import re
import socket
import stat
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from specdec.cli._shared import fail, head_on_device_remedy

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_server(server: str | None) -> list[str] | None:
    """The addresses of ``--server`` (None without it), or exit: empty, a URL, no port, a port out of range."""
    if server is None:
        return None
    from specdec_runtime.common.errors import InvalidRequestError
    from specdec_runtime.edge_client.transport.connections import parse_addresses

    try:
        return parse_addresses(server)
    except InvalidRequestError as e:
        fail(f"--server: {e}")


def check_device_names(device: str, dtype: str) -> None:
    """Exit on a device or dtype name no torch would accept (the CUDA check itself needs torch: later)."""
    if not _DEVICE_RE.match(str(device).strip().lower()):
        fail(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N")
    if str(dtype).strip().lower() not in _DTYPES:
        fail(f"unknown dtype {dtype!r}: use {', '.join(_DTYPES)}")


def resolve_draft_option(draft: str | os.PathLike | None, flag: str = "--draft") -> Path | None:
    """The directory ``--draft`` (or ``flag``: ``--device-draft``) names (every command that drafts): a prepared
    draft's name (int8, distilled, head) or a directory (an ONNX draft or a draft head), through
    :func:`specdec.models.named_drafts.resolve_named_draft`; None without the flag. Exits with one line: an unknown
    name or a draft that is not prepared (naming the command that prepares it), a directory with no draft."""
    if draft is None:
        return None
    from specdec_runtime.common.paths import ModelNotFoundError

    from specdec.models.named_drafts import resolve_named_draft

    try:
        return resolve_named_draft(str(draft))
    except ModelNotFoundError as e:
        fail(f"{flag}: {e}")


def resolve_device_draft(device_draft: str | os.PathLike | None, *, target_only: bool,
                         drafter: str = "model") -> Path | None:
    """The ONNX draft directory ``--device-draft`` names (as :func:`resolve_draft_option`), None without it; its
    tokenizer is read. Exits with one line: a draft head (it cannot decode alone), --target-only or --drafter
    ngram (no draft model drafts, so none decodes beside one), or what :func:`resolve_draft_option` refuses."""
    path = resolve_draft_option(device_draft, "--device-draft")
    if path is None:
        return None
    from specdec.models.named_drafts import is_head_dir

    if is_head_dir(path):
        fail(f"--device-draft {path} is a draft head (it drafts from the verifier's features and cannot decode "
             "alone): give --device-draft a draft that decodes alone (int8, distilled or an ONNX draft directory)")
    if target_only or drafter != "model":
        fail("--device-draft goes with a draft model (not --target-only or --drafter ngram)")
    check_draft_tokenizer(path)  # not a head: resolve_named_draft gave the ONNX draft's directory
    return path


def check_model_dirs(target: Path | None, draft: Path | None) -> None:
    """Exit when ``--target`` is not an HF model directory or ``--draft`` holds no ONNX draft or draft head (given
    ones only)."""
    from specdec_runtime.common.paths import ModelNotFoundError, resolve_draft_dir, resolve_target_dir

    from specdec.models.named_drafts import is_head_dir

    try:
        if target is not None:
            resolve_target_dir(target)
        if draft is not None:  # an ONNX draft, or a draft head (`specdec models export-head`: head.json)
            check_draft_tokenizer(Path(draft) if is_head_dir(draft) else resolve_draft_dir(draft))
    except (ModelNotFoundError, ValueError) as e:
        fail(str(e))


def check_head_on_device(draft: Path | None, route: str, fallback: str, device_draft: Path | None = None) -> None:
    """Exit with one line when ``draft`` is a draft head (it drafts from the verifier's features) and the device
    must decode alone (``--route device`` or ``--fallback device``) with no ``device_draft`` (``--device-draft``)
    to decode there beside it."""
    from specdec.models.named_drafts import is_head_dir

    if draft is None or device_draft is not None or not is_head_dir(draft):
        return
    for where, on in (("--route device", route == "device"), ("--fallback device", fallback == "device")):
        if on:
            fail(f"{where} needs a draft that decodes alone; {draft} is a draft head (it drafts from the "
                 f"verifier's features): {head_on_device_remedy(where)}")


def check_draft_tokenizer(draft_dir: Path) -> None:
    """Exit with one line when the draft's tokenizer does not load or its chat template does not parse (a
    traceback from deep in the first generation otherwise). Parses the template; renders nothing."""
    import jinja2

    from specdec_runtime.edge_client.drafting.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(draft_dir)
        if tokenizer.chat_template:
            jinja2.Environment().parse(tokenizer.chat_template)
    except jinja2.TemplateSyntaxError as e:
        fail(f"{draft_dir}: the chat template does not parse: {e.message} (line {e.lineno})")
    except (ValueError, OSError) as e:
        fail(str(e) if str(draft_dir) in str(e) else f"{draft_dir}: cannot read the tokenizer: {e}")


def check_readable(path, flag: str) -> None:
    """Exit unless ``path`` (when given) is a file this process can read."""
    if path is None or str(path) == "":
        return
    p = Path(path)
    if not p.is_file():
        fail(f"{flag} {p}: no such file")
    try:
        with p.open("rb"):
            pass
    except OSError as e:
        fail(f"{flag} {p}: cannot read it ({e.strerror})")


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Exit when ``host:port`` cannot be bound now: in use, or an address of no interface here (port 0 = any)."""
    if not 0 <= port <= 65535:
        fail(f"{flag} must be in [0, 65535], got {port}")
    if port == 0:
        return
    bind_host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no obstacle to the server
            s.bind((bind_host, port))
    except OSError as e:
        if e.errno == 98:  # EADDRINUSE
            fail(f"{flag} {port}: the port is in use on {host} (another server runs there: stop it or choose "
                  "another port)")
        fail(f"cannot listen on {host}:{port}: {e.strerror or e}")


def start_preflight(addresses: list[str], security, *, unreachable_is_error: bool) -> Future:
    """A background probe of the verifier addresses (:func:`edge_client.transport.probe.diagnose_error`) while
    models load: its result is the error (one line) of why none can serve, or None."""
    from specdec_runtime.edge_client.transport.probe import diagnose_error

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-preflight")
    future = pool.submit(diagnose_error, addresses, security, 2.0, unreachable_is_error=unreachable_is_error)
    pool.shutdown(wait=False)
    return future


def check_num_speculative_tokens(num_speculative_tokens: int) -> None:
    """Exit unless γ (``-g``) is in [1, MAX_NUM_SPECULATIVE_TOKENS] (the most any verifier may accept)."""
    from specdec_runtime.common.types import MAX_NUM_SPECULATIVE_TOKENS

    if not 1 <= num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS:
        fail(f"--num-speculative-tokens must be in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got {num_speculative_tokens}")


def check_min_tokens(min_tokens: int, max_new_tokens: int) -> None:
    """Exit when ``--min-tokens`` exceeds ``--max-new-tokens`` (EOS would stay masked past the end)."""
    if min_tokens > max_new_tokens:
        fail(f"--min-tokens {min_tokens} is more than --max-new-tokens {max_new_tokens}: lower --min-tokens or "
              "raise --max-new-tokens")


def _tokenizer_dir(target: Path | None, draft: Path | None) -> Path | None:
    """A directory with the pair's tokenizer (the draft's, else the target's; the default models' when not given),
    None when none is there yet (the default models not prepared)."""
    from specdec_runtime.common.paths import default_model_paths

    defaults = default_model_paths()
    for d in (draft or defaults.draft_dir, target or defaults.target_dir):
        if (Path(d) / "tokenizer.json").is_file():
            return Path(d)
    return None


def check_logit_bias_vocabulary(options: dict, target: Path | None, draft: Path | None) -> None:
    """Exit when ``--logit-bias`` names a token id outside the vocabulary: the tokenizer read alone (``tokenizers``,
    no model, well under a second), before any model loads. Draft and target share it (checked at session open)."""
    bias = options.get("logit_bias")
    where = _tokenizer_dir(target, draft) if bias else None
    if where is None:
        return
    from specdec_runtime.edge_client.drafting.tokenizer import load_tokenizer

    size = len(load_tokenizer(where))
    outside = sorted(t for t in bias if not 0 <= t < size)
    if outside:
        fail(f"--logit-bias: token id {outside[0]} is outside the vocabulary [0, {size})")


def _context_tokens(target: Path | None) -> int | None:
    """The embedded verifier's context, tokens: ``max_position_embeddings`` of the target's config.json (what its
    TargetRunner reads); None when the file or the field is not there (the verifier then decides alone)."""
    import json

    from specdec_runtime.common.paths import default_model_paths

    config = Path(target or default_model_paths().target_dir) / "config.json"
    try:
        value = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def check_prompt_fits(messages: list[dict] | str, *, raw: bool, target: Path | None, draft: Path | None) -> bool:
    """Exit when the prompt leaves no room in the embedded verifier's context (the verifier's own rule: prompt
    tokens < context), counted as the client will encode it (the draft's tokenizer, the chat template unless
    ``raw``; ``messages``: a prompt string, or a conversation's first messages). Reads the tokenizer and the
    target's config.json alone (well under a second), so a prompt no model can take costs no model load. Returns
    False when it could not count (the models not prepared yet: call it again once they are)."""
    where = _tokenizer_dir(target, draft)
    context = _context_tokens(target)
    if where is None or context is None:
        return False
    from specdec_runtime.common.chat import render_chat_ids
    from specdec_runtime.edge_client.drafting.tokenizer import load_tokenizer
    from specdec_runtime.edge_client.request import encode_prompt

    import jinja2

    try:
        tokenizer = load_tokenizer(where)
        if isinstance(messages, str):
            n = len(encode_prompt(tokenizer, messages, chat=not raw))
        else:
            n = len(render_chat_ids(tokenizer, messages, add_generation_prompt=True))
    except jinja2.TemplateError as e:
        fail(f"{where}: the chat template does not render: {e}")
    except (ValueError, OSError) as e:
        fail(str(e) if str(where) in str(e) else f"{where}: cannot read the tokenizer: {e}")
    if n >= context:
        over = n - context + 1
        fail(f"the prompt is {n} tokens and the target's context is {context} tokens (prompt and reply together): "
             f"shorten the prompt by at least {over} token{'s' if over > 1 else ''}")
    return True


_CHAT_INPUT = ("specdec chat reads its messages from stdin, one a line (pipe them in, or run it in a terminal); for "
               "one prompt use specdec generate PROMPT")


def check_chat_input() -> None:
    """Exit when `chat` has no input to read: stdin closed, or the null device / an empty file."""
    try:
        st = os.fstat(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):  # sys.stdin is None when fd 0 was closed
        fail(f"stdin is closed: {_CHAT_INPUT}")
    if sys.stdin.isatty():
        return
    null = os.stat(os.devnull)
    if (stat.S_ISREG(st.st_mode) and st.st_size == 0) or (stat.S_ISCHR(st.st_mode) and st.st_rdev == null.st_rdev):
        fail_no_chat_input()


def fail_no_chat_input() -> None:
    """Exit: `chat` read no message at all from a pipe or file."""
    fail(f"no message on stdin: {_CHAT_INPUT}")


def os_error_line(e: OSError, what: str) -> str:
    """One line for an OSError about ``what`` (a flag and its path): its reason, without the errno."""
    return f"{what}: {(e.strerror or str(e)).lower()}"


def check_writable_dir(path: Path | None, flag: str) -> None:
    """Exit unless directory ``path`` (when given) exists or can be made, and a file can be written in it."""
    if path is None:
        return
    import tempfile

    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"{flag} {path}: cannot create the directory ({(e.strerror or str(e)).lower()})")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        fail(f"{flag} {path}: cannot write there ({(e.strerror or str(e)).lower()})")
