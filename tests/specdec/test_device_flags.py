"""--device/--dtype of `specdec serve`, `generate` and `bench`, as a user runs them (subprocesses): `serve --device
cpu` serves; `--device cuda` where there is no CUDA (CUDA_VISIBLE_DEVICES="" on a GPU machine too) exits at once
with one line, before any model loads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.timeout(240)

STARTUP_S = 120.0


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", SPECDEC_TORCH_THREADS="1")
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _specdec(*args: str) -> list[str]:
    return [sys.executable, "-m", "specdec.cli", *args]


@pytest.mark.slow  # > 10 s here (measured): the full suite runs it, the quick tier does not
def test_serve_device_cpu_serves(tiny_pair):
    port = _free_port()
    proc = subprocess.Popen(
        _specdec("serve", "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
                 "--metrics-port", "0", "--target", str(tiny_pair.target_dir)),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + STARTUP_S
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service="specdec.v1.Verifier"), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.25)
        assert status == health_pb2.HealthCheckResponse.SERVING, proc.stderr.read() if proc.poll() is not None else ""
    finally:
        channel.close()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0


@pytest.mark.parametrize("command", [
    ("serve", "--device", "cuda", "--port", "0", "--metrics-port", "0"),
    ("serve", "--device", "cuda:0", "--dtype", "bfloat16", "--port", "0", "--metrics-port", "0"),
    ("generate", "hello", "--device", "cuda"),
    ("bench", "--device", "cuda", "--limit", "1"),
])
def test_cuda_without_cuda_exits_with_one_line(command):
    t0 = time.monotonic()
    res = subprocess.run(_specdec(*command), env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                         timeout=120)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and "CUDA is not available" in lines[0]
    assert time.monotonic() - t0 < 60  # refused before any model loads


def test_unknown_device_is_one_line():
    res = subprocess.run(_specdec("serve", "--device", "tpu", "--port", "0", "--metrics-port", "0"), env=_env(),
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "device" in lines[0], res.stderr
