"""docker-compose.yml (with docker-compose.override.yml, its published ports), the Dockerfiles and the Kubernetes
manifests agree with the code (no Docker needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specdec_runtime.cloud_verifier.config import VerifierSettings

ROOT = Path(__file__).resolve().parents[2]
ENV_PREFIX = "SPECDEC_"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def ports() -> dict:
    """The published ports of each service (docker-compose.override.yml)."""
    services = yaml.safe_load((ROOT / "docker-compose.override.yml").read_text())["services"]
    return {name: service["ports"] for name, service in services.items()}


def _default(value: str) -> str:
    """``${VAR:-default}`` as compose reads it with VAR unset."""
    return value.split(":-", 1)[1].rstrip("}") if value.startswith("${") else value


def _setting_name(env_name: str) -> str:
    assert env_name.startswith(ENV_PREFIX), env_name
    return env_name[len(ENV_PREFIX):].lower()


def _env_dict(env) -> dict[str, str]:
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in (env or {}).items()}


def _container_ports(ports) -> set[int]:
    out = set()
    for p in ports:
        p = str(p["target"]) if isinstance(p, dict) else str(p)
        out.add(int(p.split(":")[-1].split("/")[0]))
    return out


def test_services_exist(compose, ports):
    assert {"redis", "verifier", "edge-demo"} <= set(compose["services"])
    assert _default(compose["services"]["redis"]["image"]).startswith("redis:7")
    assert 6379 in _container_ports(ports["redis"])
    # published ports live in the override alone: host networking (deploy/compose.host.yml) cannot have any
    assert not any("ports" in service for service in compose["services"].values())


def test_verifier_env_and_ports_match_settings(compose, ports):
    verifier = compose["services"]["verifier"]
    env = _env_dict(verifier["environment"])
    fields = VerifierSettings.model_fields
    for name in env:
        assert _setting_name(name) in fields, f"{name} is not a VerifierSettings field"
    assert env["SPECDEC_REDIS_URL"].startswith("redis://redis:6379")
    grpc_port, metrics_port = int(env["SPECDEC_PORT"]), int(env["SPECDEC_METRICS_PORT"])
    defaults = (fields["port"].default, fields["metrics_port"].default)
    assert (grpc_port, metrics_port) == defaults == (50051, 9090)
    assert {grpc_port, metrics_port} <= _container_ports(ports["verifier"])
    # the env really configures the settings
    settings = VerifierSettings(**{_setting_name(k): v for k, v in env.items()})
    assert settings.redis_url == env["SPECDEC_REDIS_URL"] and settings.port == grpc_port


def test_verifier_healthcheck_uses_grpc_health(compose):
    test = compose["services"]["verifier"]["healthcheck"]["test"]
    cmd = " ".join(test) if isinstance(test, list) else test
    assert "specdec_runtime.cloud_verifier.serving.healthcheck" in cmd
    import specdec_runtime.cloud_verifier.serving.healthcheck as hc

    assert hc.DEFAULT_SERVICE == "specdec.v1.Verifier"


def test_edge_demo(compose):
    edge = compose["services"]["edge-demo"]
    cmd = edge["command"]
    cmd = cmd if isinstance(cmd, list) else cmd.split()
    assert cmd[:2] == ["specdec", "generate"] and "--server" in cmd
    assert cmd[cmd.index("--server") + 1] == "balancer:50051"  # nginx in front of the replicas
    assert "balancer" in edge["depends_on"]


def test_dockerfiles_build_offline_and_prepare_or_mount_models(compose):
    """Every Python package from the wheelhouse (no index), torch's CPU build pinned, the models prepared at build
    time or left to a mount, the base images build arguments, a non-root user; the edge's runtime stage without
    torch; every COPY source admitted by .dockerignore (the build context is the wheelhouse)."""
    admitted = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.startswith("!")]
    for name in ("verifier", "edge-demo"):
        build = compose["services"][name]["build"]
        context = ROOT / build.get("context", ".")
        dockerfile = context / build["dockerfile"]
        assert dockerfile.is_file(), dockerfile
        text = dockerfile.read_text()
        assert "PIP_NO_INDEX=1" in text and "PIP_FIND_LINKS=/wheels" in text and "torch==2.13.0" in text
        assert "specdec models prepare" in text and '"$MODELS" = prepare' in text
        assert {"BASE_IMAGE", "BUILDER_IMAGE", "MODELS"} <= set(build["args"])
        assert "ARG BASE_IMAGE=python:3.11-slim" in text and "\nUSER specdec\n" in text
        runtime = text[text.rindex("\nFROM "):]
        assert "torch" not in runtime.replace("HF_HUB", "") or name == "verifier"
        for line in text.splitlines():
            parts = line.split()
            if parts and parts[0] == "COPY" and not any(p.startswith("--from") for p in parts):
                for src in parts[1:-1]:
                    assert any(src.rstrip("/") == a or src.startswith(a + "/") for a in admitted), src
    assert "prebuild" in (ROOT / "deploy" / "Dockerfile.verifier").read_text()  # the compiled verdict scan


def test_env_example_names_are_settings():
    for line in (ROOT / "deploy" / "verifier.env.example").read_text().splitlines():
        line = line.strip().lstrip("#").strip()
        if line.startswith(ENV_PREFIX) and "=" in line:
            assert _setting_name(line.split("=", 1)[0]) in VerifierSettings.model_fields, line


def test_k8s_manifests():
    docs = {}
    for f in ("verifier.yaml", "redis.yaml"):
        for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / f).read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    deploy = docs[("Deployment", "specdec-verifier")]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    for name in env:
        assert _setting_name(name) in VerifierSettings.model_fields, name
    secret_ref = env["SPECDEC_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    secret = docs[("Secret", secret_ref["name"])]
    assert secret_ref["key"] in secret["stringData"]
    assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": "specdec.v1.Verifier"}
    service = docs[("Service", "specdec-verifier")]
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert {p["port"] for p in service["spec"]["ports"]} == {50051, 9090}
    assert ("Service", "redis") in docs and ("Deployment", "redis") in docs
