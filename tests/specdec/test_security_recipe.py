"""The certificate recipe of docs/security.md works as written: its OpenSSL commands make a chain a verifier can
serve and the edge trusts, for the names its subjectAltName lists (and for no other)."""

from __future__ import annotations

import re
import subprocess
from concurrent import futures
from pathlib import Path

import grpc

from specdec_runtime.edge_client.transport.credentials import ChannelSecurity
from specdec_runtime.edge_client.transport.probe import diagnose

ROOT = Path(__file__).resolve().parents[2]


def _recipe() -> list[str]:
    text = (ROOT / "docs" / "security.md").read_text()
    section = text.split("## Certificates", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = block.replace("\\\n", " ").splitlines()
    return [c for c in commands if c.strip() and not c.startswith("specdec ")]


def test_recipe_makes_a_chain_the_edge_trusts(tmp_path):
    for command in _recipe():
        subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True, capture_output=True, timeout=120)
    server = grpc.server(futures.ThreadPoolExecutor(1))
    creds = grpc.ssl_server_credentials([((tmp_path / "server.key").read_bytes(),
                                          (tmp_path / "server.pem").read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        trusted = ChannelSecurity.of(root_certificates=str(tmp_path / "ca.pem"), use_env=False)
        for address in (f"127.0.0.1:{port}", f"localhost:{port}"):  # both in the subjectAltName
            assert diagnose([address], trusted) is None
        other = ChannelSecurity.of(root_certificates=str(tmp_path / "ca.pem"), server_name="elsewhere.example",
                                   use_env=False)
        assert "does not name 'elsewhere.example'" in diagnose([f"127.0.0.1:{port}"], other)
        assert "not trusted" in diagnose([f"127.0.0.1:{port}"], ChannelSecurity.of(tls=True, use_env=False))
    finally:
        server.stop(None)
