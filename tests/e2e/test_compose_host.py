"""deploy/compose.host.yml (host networking, for hosts without a bridge) agrees with docker-compose.yml, its
nginx config and the Sentinel overrides: every service on the host's network, every address a distinct port of
127.0.0.1, the balancer's upstreams the replicas' ports, the sentinels' master the primary's port, the verifiers'
sentinel URL the sentinels' ports, and scripts/deploy_generate.py on the same ports (no Docker needed)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from specdec_runtime.cloud_verifier.config import VerifierSettings
from specdec_runtime.cloud_verifier.store.redis_connect import SENTINEL, parse_redis_url

ROOT = Path(__file__).resolve().parents[2]


def _services(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())["services"]


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _settings(env: dict) -> VerifierSettings:
    return VerifierSettings(**{k.removeprefix("SPECDEC_").lower(): v for k, v in env.items()})


def test_every_service_on_the_host_network_on_its_own_loopback_port():
    base, host = _services("docker-compose.yml"), _services("deploy/compose.host.yml")
    assert set(host) == set(base)
    assert all(service["network_mode"] == "host" for service in host.values())
    ports = [int(_flag(host[name]["command"], "--port")) for name in host if name.startswith("redis")]
    ports += [int(host[name]["environment"]["PORT"]) for name in host if name.startswith("sentinel")]
    for name in ("verifier", "verifier-b"):
        settings = _settings({**base[name]["environment"], **host[name]["environment"]})
        assert settings.host == "127.0.0.1" and settings.redis_url.startswith("redis://127.0.0.1:16379/")
        ports += [settings.port, settings.metrics_port]
    for name in host:
        if name.startswith("redis"):
            assert _flag(host[name]["command"], "--bind") == "127.0.0.1"
            assert str(_flag(host[name]["command"], "--port")) in host[name]["healthcheck"]["test"]
    conf = (ROOT / "deploy" / "nginx" / "nginx.host.conf").read_text()
    listen = int(re.search(r"listen 127\.0\.0\.1:(\d+) http2;", conf).group(1))
    ports.append(listen)
    assert len(ports) == len(set(ports)) == 12
    upstreams = [int(p) for p in re.findall(r"^\s*server 127\.0\.0\.1:(\d+)", conf, re.MULTILINE)]
    assert upstreams == [int(host[n]["environment"]["SPECDEC_PORT"]) for n in ("verifier", "verifier-b")]
    assert _flag(host["edge-demo"]["command"], "--server") == f"127.0.0.1:{listen}"
    script = (ROOT / "scripts" / "deploy_generate.py").read_text()
    assert f'BALANCER = "127.0.0.1:{listen}"' in script
    metrics = {n: int(host[n]["environment"]["SPECDEC_METRICS_PORT"]) for n in ("verifier", "verifier-b")}
    assert f"METRICS = {metrics!r}".replace("'", '"') in script


def test_the_sentinel_profile_on_the_host_network():
    host, override = _services("deploy/compose.host.yml"), _services("deploy/compose.host-sentinel.yml")
    primary = _flag(host["redis-primary"]["command"], "--port")
    for name in ("redis-replica-1", "redis-replica-2"):
        command = host[name]["command"]
        assert command[command.index("--replicaof") + 1:][:2] == ["127.0.0.1", primary]
    sentinels = {("127.0.0.1", int(host[f"sentinel-{i}"]["environment"]["PORT"])) for i in (1, 2, 3)}
    assert {host[f"sentinel-{i}"]["environment"]["MASTER"] for i in (1, 2, 3)} == {f"127.0.0.1 {primary}"}
    for name in ("verifier", "verifier-b"):
        target = parse_redis_url(_settings(override[name]["environment"]).redis_url)
        assert target.kind == SENTINEL and set(target.hosts) == sentinels and target.service_name == "mymaster"
    # `up balancer` starts what the verifiers depend on: the replicas too (SPECDEC_REDIS_WAIT_REPLICAS needs one)
    sentinel_override = _services("deploy/compose.sentinel.yml")
    for name in ("verifier", "verifier-b"):
        assert {"redis-primary", "redis-replica-1", "redis-replica-2"} - set(sentinel_override[name]["depends_on"]) \
            <= {"redis-primary"}
    # the sentinel's configuration and health check come from its environment, in both networkings
    sentinel = _services("docker-compose.yml")["sentinel-1"]
    assert {"$$PORT", "$$ANNOUNCE", "$$MASTER"} <= set(re.findall(r"\$\$[A-Z]+", sentinel["command"][2]))
    assert "$$PORT" in sentinel["healthcheck"]["test"][1]


def test_models_mount_and_the_check_script_use_the_same_files():
    mounts = _services("deploy/compose.models.yml")
    assert set(mounts) == {"verifier", "verifier-b", "edge-demo"}
    assert all(m["volumes"][0].endswith(":/opt/specdec/models:ro") for m in mounts.values())
    script = (ROOT / "scripts" / "deploy_check.sh").read_text()
    for f in ("deploy/compose.host.yml", "deploy/compose.models.yml", "deploy/compose.sentinel.yml",
              "deploy/compose.host-sentinel.yml"):
        assert f"-f {f}" in script and (ROOT / f).is_file()
