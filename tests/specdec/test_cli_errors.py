"""Errors as a user meets them, through the CLI in a subprocess: one ``error: ...`` line that says what to do,
exit status 2, before any model loads where the input alone shows the error: the subprocess reports which model
runtimes (torch, ONNX Runtime) it imported, and such an error imports neither (a machine's load cannot make this
check flaky, as a wall-clock bound did).

Argument errors (address form, missing directories, used ports), TLS mismatches named as such (a bare TLS gRPC
server of this process: the handshake is all the client reaches), the verifier lost mid-run, --help/--version.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from _pki import make_pki

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
MODEL_RUNTIMES = ("torch", "onnxruntime")
# `specdec ARGS` that writes, at exit, the model runtimes it imported to $SPECDEC_TEST_RUNTIMES_OUT
_CLI = ("import atexit, os, sys\n"
        "def _report():\n"
        f"    loaded = [m for m in {MODEL_RUNTIMES!r} if sys.modules.get(m) is not None]\n"
        "    with open(os.environ['SPECDEC_TEST_RUNTIMES_OUT'], 'w') as f:\n"
        "        f.write(','.join(loaded))\n"
        "atexit.register(_report)\n"
        "sys.argv[0] = 'specdec'\n"
        "from specdec.cli import main\n"
        "main()\n")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", _CLI, *args]


def _runtimes(out: Path) -> list[str]:
    """The model runtimes a finished `_cli` process imported (read from ``out``)."""
    assert out.exists(), "the CLI exited without reporting what it imported (killed?)"
    return [m for m in out.read_text().split(",") if m]


def _specdec(*args: str, timeout: float = 60, env: dict | None = None,
             stdin: str | None = None) -> tuple[int, str, str, list[str]]:
    """(exit status, stdout, stderr, model runtimes imported) of `specdec ARGS`; ``stdin``: its input (None: none,
    as /dev/null)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runtimes"
        proc = subprocess.run(_cli(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {}), "SPECDEC_TEST_RUNTIMES_OUT": str(out)},
                              input=stdin, stdin=subprocess.DEVNULL if stdin is None else None)
        return proc.returncode, proc.stdout, proc.stderr, _runtimes(out)


def _one_error(args, expected: str, models_may_load: bool = False, **kw) -> str:
    """The one ``error:`` line of `specdec ARGS` (exit 2); unless ``models_may_load`` (the error needs the
    network or a loaded draft to show), it came before any model runtime was imported."""
    rc, _, err, runtimes = _specdec(*args, **kw)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err  # one line, no traceback, no gRPC log
    assert expected in lines[0], lines[0]
    assert models_may_load or not runtimes, f"{lines[0]}: imported {runtimes} before refusing"
    return lines[0]


@pytest.fixture
def used_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_help_and_version_are_fast():
    rc, out, _, runtimes = _specdec("--help")
    assert rc == 0 and "generate" in out and not runtimes
    rc, out, _, runtimes = _specdec("--version")
    assert rc == 0 and out.startswith("specdec ") and not runtimes
    from importlib.metadata import version  # the distribution's name, not PyPI's unrelated "specdec"

    assert out.strip() == f"specdec {version('specdec-edgecloud')}", out


@pytest.mark.parametrize("server, expected", [
    ("localhost", "'localhost' is not HOST:PORT"),
    ("http://localhost:50051", "is a URL: give HOST:PORT"),
    ("127.0.0.1:99999", "port 99999 is not in [1, 65535]"),
    (":50051", "is not HOST:PORT"),
])
def test_malformed_server(server, expected):
    _one_error(["generate", "--server", server, "hi"], expected)


def test_missing_model_directories(tmp_path):
    _one_error(["generate", "--target", str(tmp_path / "nope"), "hi"], "no HF causal-LM directory")
    _one_error(["generate", "--server", "127.0.0.1:1", "--draft", str(tmp_path / "nope"), "hi"], "no ONNX draft")
    _one_error(["chat", "--target", str(tmp_path / "nope")], "no HF causal-LM directory")


def test_bad_device_name():
    _one_error(["generate", "--device", "tpu", "hi"], "unknown device 'tpu'")


def test_port_in_use(used_port):
    _one_error(["serve", "--port", str(used_port), "--metrics-port", "0"], f"--port {used_port}: the port is in use")
    _one_error(["serve", "--port", "0", "--metrics-port", str(used_port)], f"--metrics-port {used_port}")
    _one_error(["edge-serve", "--port", str(used_port), "--server", "127.0.0.1:1"],
               f"--port {used_port}: the port is in use")


def test_one_port_for_grpc_and_metrics_and_a_plot_without_its_directory(tmp_path):
    """Refused up front, one line each (they failed after the model loaded, or after the whole benchmark ran)."""
    _one_error(["serve", "--port", "50998", "--metrics-port", "50998"], "--metrics-port must differ from --port")
    missing = tmp_path / "no-such-dir" / "grid.png"
    _one_error(["bench", "--wan", "0", "--limit", "1", "--plot", str(missing)], "--plot: no directory")
    _one_error(["bench", "--gamma-sweep", "1,2", "--limit", "1", "--plot", str(missing)], "--plot: no directory")


def test_serve_tls_files_missing(tmp_path):
    _one_error(["serve", "--port", "0", "--metrics-port", "0", "--tls-cert-file", str(tmp_path / "c.pem"),
                "--tls-key-file", str(tmp_path / "k.pem")], "no such file")


def test_nothing_listens(tiny_pair):
    _one_error(["generate", "--server", "127.0.0.1:1", "--draft", str(tiny_pair.draft_dir), "hi"],
               "cannot reach verifier at 127.0.0.1:1: connection refused")


def test_a_peer_that_is_not_a_verifier_is_named(tiny_pair, redis_url):
    """An HTTP/1.1 server or Redis at --server: the peer answered, so not "no connection within 10 s"; edge-serve
    (which starts while no verifier answers, and with --fallback device) does not start on it."""
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread
    from urllib.parse import urlsplit

    http = ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    Thread(target=http.serve_forever, daemon=True).start()
    redis = urlsplit(redis_url)
    try:
        for address in (f"127.0.0.1:{http.server_address[1]}", f"{redis.hostname}:{redis.port or 6379}"):
            line = _one_error(["generate", "--server", address, "--draft", str(tiny_pair.draft_dir), "hi"],
                              f"error: {address} is not a specdec verifier: ", models_may_load=True)
            assert "no connection within" not in line
            _one_error(["edge-serve", "--port", "0", "--server", address, "--fallback", "device", "--draft",
                        str(tiny_pair.draft_dir)], f"error: {address} is not a specdec verifier: ",
                       models_may_load=True)
    finally:
        http.shutdown()
        http.server_close()


@pytest.fixture(scope="module")
def tls_servers(tmp_path_factory):
    """(pki, TLS address, plaintext address) of a bare gRPC server (no services)."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    server = grpc.server(futures.ThreadPoolExecutor(2))
    creds = grpc.ssl_server_credentials([(pki.read("server_key"), pki.read("server_cert"))])
    tls_port = server.add_secure_port("127.0.0.1:0", creds)
    plain_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield pki, f"127.0.0.1:{tls_port}", f"127.0.0.1:{plain_port}"
    server.stop(None)


def test_tls_mismatches_are_named(tls_servers, tiny_pair):
    pki, tls_address, plain_address = tls_servers
    draft = ["--draft", str(tiny_pair.draft_dir)]
    _one_error(["generate", "--server", tls_address, *draft, "hi"], "the verifier at " + tls_address +
               " speaks TLS: add --tls")
    _one_error(["generate", "--server", tls_address, "--tls", *draft, "hi"],
               "the verifier's certificate is not trusted: pass --ca-cert FILE")
    _one_error(["generate", "--server", tls_address, "--ca-cert", str(pki.other_ca_cert), *draft, "hi"],
               "is not signed by the --ca-cert given")
    _one_error(["generate", "--server", plain_address, "--ca-cert", str(pki.ca_cert), *draft, "hi"],
               "does not speak TLS: drop --tls")
    _one_error(["chat", "--server", tls_address, *draft], "speaks TLS: add --tls", stdin="hi\n")


def test_verifier_lost_mid_run(tiny_pair):
    """The verifier stops mid-generation: the documented `error: cannot reach verifier at ...`, exit 2."""
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec.embedded import EmbeddedServer

    embedded = EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir)), grace_s=0.5)
    address = embedded.start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "generate", "--server", address, "--draft", str(tiny_pair.draft_dir),
         "--max-new-tokens", "400", "--ignore-eos", "--fixed-gamma", "-g", "1", "--network-delay-ms", "30",
         "--no-proactive", "Tell a long story."],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.read(1)  # text is streaming
        embedded.stop()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach verifier at {address}"), err


def test_wrong_api_key(tiny_pair, tmp_path):
    """A verifier with API keys: a wrong or missing key is one line that names the key, exit 2."""
    from specdec_runtime.cloud_verifier.security.auth import ApiKeyStore, append_api_key
    from specdec_runtime.cloud_verifier.security.transport import ServerSecurity
    from specdec_runtime.cloud_verifier.target.runner import TargetRunner
    from specdec_runtime.cloud_verifier.verifier import Verifier
    from specdec.embedded import EmbeddedServer

    keys = tmp_path / "keys"
    append_api_key(keys, "acme")
    security = ServerSecurity(None, ApiKeyStore(keys))
    with EmbeddedServer(verifier=Verifier(TargetRunner(tiny_pair.target_dir)), grace_s=0.5,
                        security=security) as address:
        base = ["generate", "--server", address, "--draft", str(tiny_pair.draft_dir), "--max-new-tokens", "2", "hi"]
        _one_error([*base, "--api-key", "sk-specdec-wrong"], "invalid API key: pass the verifier's key with --api-key",
                   models_may_load=True)
        _one_error(base, "API key", models_may_load=True, env={"SPECDEC_API_KEY": ""})


def _edge_only(tmp_path: Path) -> dict:
    """The environment of an edge-only install (`specdec-edgecloud[edge]`): the verifier's packages hidden
    from the subprocess (a sitecustomize that marks them absent)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nfor m in ('torch', 'transformers', 'pydantic_settings'):\n    sys.modules[m] = None\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_edge_only_install_names_the_missing_extra(tmp_path, tiny_pair):
    """Without the verifier's packages, what needs them (the embedded verifier, serve, bench, models prepare) says
    which extra to install, in one line; the edge alone (--server) still runs as far as the network."""
    env = _edge_only(tmp_path)
    for args, extra in ((["generate", "--draft", str(tiny_pair.draft_dir), "--target", str(tiny_pair.target_dir),
                          "hi"], "verifier"), (["serve", "--target", str(tiny_pair.target_dir)], "verifier"),
                        (["bench", "--limit", "1"], "tools"), (["models", "prepare"], "tools")):
        line = _one_error(args, f"needs specdec-edgecloud[{extra}] (torch, transformers", env=env)
        # installed from a clone or a built wheel: never a bare name, which an index resolves to another project
        assert "pip install -e '.[all]' in a clone" in line and "specdec_edgecloud-" in line, line
        assert "pip install 'specdec" not in line and "pip install specdec" not in line, line
    _one_error(["generate", "--server", "127.0.0.1:1", "--draft", str(tiny_pair.draft_dir), "hi"],
               "cannot reach verifier at 127.0.0.1:1: connection refused", models_may_load=True, env=env)


def test_min_tokens_above_max_new_tokens(tiny_pair):
    """It stopped at max_new_tokens without a word; now refused before anything loads (the SDK refuses it too)."""
    _one_error(["generate", "--server", "127.0.0.1:1", "--draft", str(tiny_pair.draft_dir), "--min-tokens", "50",
                "--max-new-tokens", "5", "hi"], "--min-tokens 50 is more than --max-new-tokens 5")
    _one_error(["chat", "--server", "127.0.0.1:1", "--min-tokens", "9", "--max-new-tokens", "8"],
               "--min-tokens 9 is more than --max-new-tokens 8")


@pytest.mark.parametrize("command", ["generate", "chat", "edge-serve"])
def test_speculative_tokens_and_max_new_tokens_have_limits(command):
    """-g 1000 and a max_new_tokens no context holds were accepted silently (and the verifier cut γ to its own
    maximum); the message names the limit (common.types)."""
    from specdec_runtime.common.types import MAX_NEW_TOKENS, MAX_NUM_SPECULATIVE_TOKENS

    prompt = ["hi"] if command == "generate" else []
    _one_error([command, "--server", "127.0.0.1:1", "-g", "1000", *prompt],
               f"--num-speculative-tokens must be in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got 1000")
    if command != "edge-serve":
        _one_error([command, "--server", "127.0.0.1:1", "--max-new-tokens", "100000000000", *prompt],
                   f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got 100000000000")


def test_chat_without_input_says_so():
    """stdin closed, or empty: one line saying chat reads its messages there, exit 2, before any model loads
    (it exited 0 without a word after loading the models)."""
    base = _cli("chat", "--server", "127.0.0.1:1")
    for stdin, expected in ((subprocess.DEVNULL, "no message on stdin"), (None, "stdin is closed")):
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "SPECDEC_TEST_RUNTIMES_OUT": str(Path(tmp) / "runtimes")}
            if stdin is None:  # fd 0 closed, as `specdec chat <&-` leaves it
                proc = subprocess.run(["sh", "-c", 'exec "$@" <&-', "sh", *base], cwd=ROOT, capture_output=True,
                                      text=True, timeout=60, env=env)
            else:
                proc = subprocess.run(base, cwd=ROOT, stdin=stdin, capture_output=True, text=True, timeout=60,
                                      env=env)
            runtimes = _runtimes(Path(tmp) / "runtimes")
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
        assert "specdec generate" in lines[0] and not runtimes, runtimes


@pytest.mark.slow  # > 10 s here (measured): the full suite runs it, the quick tier does not
def test_chat_from_a_pipe_that_sends_nothing(tiny_pair):
    """A pipe cannot be known empty before reading it: the models load, then the same one line, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--target", str(tiny_pair.target_dir),
                           "--draft", str(tiny_pair.draft_dir), "--device", "cpu"], cwd=ROOT, input="",
                          capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and lines == [lines[0]] and "no message on stdin" in lines[0], proc.stderr


def test_unwritable_paths_are_one_line_without_errno():
    line = _one_error(["models", "prepare", "--cache-dir", "/proc/nope"], "--cache-dir /proc/nope: cannot create")
    assert "Errno" not in line
    for command in (["keys", "create", "--tenant", "acme"], ["keys", "list"]):
        line = _one_error([*command, "--file", "/proc"], "--file /proc: is a directory")
        assert "Errno" not in line


def test_help_shows_no_bool_placeholder():
    for args in (["--help"], ["generate", "--help"], ["chat", "--help"], ["bench", "--help"],
                 ["keys", "create", "--help"], ["models", "prepare", "--help"]):
        rc, out, _, _ = _specdec(*args)
        assert rc == 0 and "--help" in out and "<bool>" not in out, (args, out)


def test_logit_bias_and_regex_checked_before_the_model_loads(tiny_pair):
    """Out of the vocabulary (the draft's tokenizer, read alone) and a regex the engine refuses (compiled without
    a model) are one clean line at once; both came only after the models had loaded, the regex garbled."""
    models = ["--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir)]
    _one_error(["generate", *models, "--logit-bias", "49152=1", "hi"],
               "--logit-bias: token id 49152 is outside the vocabulary [0, 49152)")
    _one_error(["chat", "--server", "127.0.0.1:1", "--draft", str(tiny_pair.draft_dir), "--logit-bias", "99999=1"],
               "--logit-bias: token id 99999 is outside the vocabulary")
    line = _one_error(["generate", *models, "--regex", "(", "hi"], "--regex: invalid regex: unclosed group")
    assert line == "error: --regex: invalid regex: unclosed group", line
    line = _one_error(["generate", *models, "--regex", "[z-a]", "hi"], "--regex: invalid regex")
    assert ";" not in line and "start:" not in line, line


def test_prompt_longer_than_the_context_refused_before_any_model_loads(tiny_pair):
    """A prompt the target's context cannot hold was refused by the verifier once the models had loaded (26 s for
    20k tokens with the default pair); now counted with the tokenizer alone, in one line, no model runtime imported."""
    models = ["--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir)]
    long = "The quick brown fox jumps over the lazy dog. " * 60  # > 512 tokens, the tiny target's context
    line = _one_error(["generate", *models, long], "the target's context is 512 tokens")
    assert "shorten the prompt by at least" in line, line
    _one_error(["generate", *models, "--raw", long], "the target's context is 512 tokens")
    _one_error(["chat", *models, "--system", long], "the target's context is 512 tokens")


def test_prompt_fits_check_is_the_verifiers_rule(tiny_pair, tmp_path):
    """Refused exactly when prompt tokens >= context (the verifier's "no room" rule): at context = n it exits, at
    n + 1 it passes; without a config.json to read it passes the decision on to the verifier."""
    import typer

    from specdec.cli.checks import check_prompt_fits
    from specdec_runtime.edge_client.drafting.tokenizer import load_tokenizer
    from specdec_runtime.edge_client.request import encode_prompt

    prompt = "Why is the sky blue? " * 5
    n = len(encode_prompt(load_tokenizer(tiny_pair.draft_dir), prompt))
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(f'{{"max_position_embeddings": {n}}}')
    with pytest.raises(typer.Exit):
        check_prompt_fits(prompt, raw=False, target=target, draft=tiny_pair.draft_dir)
    (target / "config.json").write_text(f'{{"max_position_embeddings": {n + 1}}}')
    assert check_prompt_fits(prompt, raw=False, target=target, draft=tiny_pair.draft_dir) is True
    (target / "config.json").unlink()
    assert check_prompt_fits(prompt, raw=False, target=target, draft=tiny_pair.draft_dir) is False


def test_gamma_option_has_one_declaration():
    """`-g/--num-speculative-tokens` was declared in four commands with two helps; now one Annotated alias
    (specdec/cli/_shared.py): every command that drafts shows the same option, default and help."""
    import typer.main

    from specdec.cli import app
    from specdec.cli._shared import DEFAULT_NUM_SPECULATIVE_TOKENS

    declared = [p for p in (ROOT / "specdec" / "cli").glob("*.py") if '"-g"' in p.read_text()]
    assert [p.name for p in declared] == ["_shared.py"], declared
    commands = typer.main.get_command(app).commands
    options = {name: next(p for p in commands[name].params if "-g" in p.opts)
               for name in ("generate", "chat", "edge-serve", "bench")}
    assert {o.default for o in options.values()} == {DEFAULT_NUM_SPECULATIVE_TOKENS}
    assert len({o.help for o in options.values()}) == 1
    assert all(o.opts == ["--num-speculative-tokens", "-g"] for o in options.values()), options


def test_a_draft_with_a_broken_tokenizer_or_template_is_one_line(tiny_pair, tmp_path):
    """A draft folder whose tokenizer.json does not parse, or whose chat template does not, gave a traceback
    from the first generation; now one line naming the folder, before any model loads."""
    broken_tokenizer, broken_template = tmp_path / "tok", tmp_path / "tpl"
    shutil.copytree(tiny_pair.draft_dir, broken_tokenizer)
    (broken_tokenizer / "tokenizer.json").write_text("{bad")
    shutil.copytree(tiny_pair.draft_dir, broken_template)
    (broken_template / "chat_template.jinja").write_text("{% if")
    for command in (["generate", "hi"], ["chat"]):
        server = ["--server", "127.0.0.1:1"]
        _one_error([command[0], *server, "--draft", str(broken_tokenizer), *command[1:]],
                   f"{broken_tokenizer}: cannot read the tokenizer", stdin="hi\n")
        _one_error([command[0], *server, "--draft", str(broken_template), *command[1:]],
                   f"{broken_template}: the chat template does not parse", stdin="hi\n")
