"""The Sentinel deployment (docs/session-store.md) agrees with the code: the Kubernetes manifests are valid
against Kubernetes' own schemas (kubernetes-validate, strict), the session-store URL they hand the verifiers
parses as Sentinel and names the sentinel pods, the shell scripts parse; docker compose's profile "sentinel"
and its override name existing services and settings."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from specdec_runtime.cloud_verifier.config import VerifierSettings
from specdec_runtime.cloud_verifier.store.redis_connect import SENTINEL, parse_redis_url

ROOT = Path(__file__).resolve().parents[2]
SENTINEL_K8S = ROOT / "deploy" / "k8s" / "sentinel" / "redis-sentinel.yaml"
K8S_VERSION = "1.30"


def _docs() -> dict:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(SENTINEL_K8S.read_text()) if d}


def test_manifests_are_valid_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = _docs()
    assert {("StatefulSet", "redis"), ("StatefulSet", "redis-sentinel"), ("Secret", "specdec-redis")} <= set(docs)
    for doc in docs.values():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_topology_and_the_url_the_verifiers_get():
    docs = _docs()
    redis, sentinels = docs[("StatefulSet", "redis")], docs[("StatefulSet", "redis-sentinel")]
    assert redis["spec"]["replicas"] == 3 and sentinels["spec"]["replicas"] == 3  # 1 master + 2 replicas; 3
    target = parse_redis_url(docs[("Secret", "specdec-redis")]["stringData"]["url"])
    headless = sentinels["spec"]["serviceName"]
    assert target.kind == SENTINEL and target.service_name == "mymaster"
    assert [h for h, _ in target.hosts] == [f"redis-sentinel-{i}.{headless}" for i in range(3)]
    assert {p for _, p in target.hosts} == {26379}
    # verifier.yaml reads this Secret's key
    verifier = next(d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "verifier.yaml").read_text())
                    if d and d["kind"] == "Deployment")
    env = {e["name"]: e for e in verifier["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = env["SPECDEC_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "specdec-redis" and ref["key"] in docs[("Secret", "specdec-redis")]["stringData"]


def test_scripts_parse():
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    scripts = _docs()[("ConfigMap", "redis-sentinel-scripts")]["data"]
    assert {"master.sh", "redis.sh", "sentinel.sh"} == set(scripts)
    for name, text in scripts.items():
        out = subprocess.run([sh, "-n"], input=text, capture_output=True, text=True, timeout=10)
        assert out.returncode == 0, (name, out.stderr)


def test_compose_profile_and_override():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ha = {name for name, s in services.items() if "sentinel" in s.get("profiles", [])}
    assert ha == {"redis-primary", "redis-replica-1", "redis-replica-2", "sentinel-1", "sentinel-2", "sentinel-3"}
    assert not services["verifier"].get("profiles")  # the default stack is unchanged
    override = yaml.safe_load((ROOT / "deploy" / "compose.sentinel.yml").read_text())["services"]
    for name in ("verifier", "verifier-b"):
        env = override[name]["environment"]
        settings = VerifierSettings(**{k.removeprefix("SPECDEC_").lower(): v for k, v in env.items()})
        target = parse_redis_url(settings.redis_url)
        assert target.kind == SENTINEL and {h for h, _ in target.hosts} == {"sentinel-1", "sentinel-2", "sentinel-3"}
        assert settings.redis_wait_replicas == 1
        assert set(override[name]["depends_on"]) <= ha
