"""The deployment of the failover setup: Kubernetes manifests validated against Kubernetes' own schemas
(kubernetes-validate, strict: unknown fields fail), the balancer's settings the same in docker compose, the
nginx config and the Kubernetes ConfigMap, and the header nginx hashes on the one the SDK sends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30"  # native gRPC probes are GA since 1.27
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"


def _docs() -> dict:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def test_every_manifest_is_valid_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = _docs()
    assert len(docs) >= 10
    for key, doc in docs.items():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError
    # negative controls: the validator does catch a wrong type and an unknown field
    bad = yaml.safe_load(yaml.safe_dump(docs[("Deployment", "specdec-verifier")]))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(docs[("Deployment", "specdec-verifier")]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["sevice"] = "typo"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_verifier_replicas_probes_drain_and_disruption_budget():
    from specdec_runtime.cloud_verifier.serving.server import LIVENESS_SERVICE, SERVICE_NAME

    docs = _docs()
    deploy = docs[("Deployment", "specdec-verifier")]
    assert deploy["spec"]["replicas"] >= 2
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": SERVICE_NAME}
    assert container["livenessProbe"]["grpc"] == {"port": 50051, "service": LIVENESS_SERVICE}
    env = {e["name"]: e.get("value") for e in container["env"]}
    grace = float(env["SPECDEC_GRACE_PERIOD_S"])
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + grace
    pdb = docs[("PodDisruptionBudget", "specdec-verifier")]
    assert pdb["spec"]["selector"] == deploy["spec"]["selector"] and pdb["spec"]["maxUnavailable"] == 1
    headless = docs[("Service", "specdec-verifier-headless")]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]


def _directives(conf: str) -> dict[str, str]:
    keep = ("hash", "grpc_read_timeout", "grpc_send_timeout", "client_body_timeout", "grpc_next_upstream",
            "grpc_next_upstream_tries", "grpc_connect_timeout", "client_max_body_size", "grpc_pass", "listen")
    out = {}
    for name, value in re.findall(r"^\s*([a-z_0-9]+)\s+([^;{]*);", conf, re.M):
        if name in keep:
            out[name] = value.strip()
    return out


def test_balancer_config_is_the_same_in_compose_nginx_conf_and_kubernetes():
    from specdec_runtime.edge_client.transport.grpc_backend import AFFINITY_HEADER

    shipped = _directives(NGINX_CONF.read_text())
    assert shipped["hash"] == f"$http_{AFFINITY_HEADER.replace('-', '_')} consistent"
    assert shipped["grpc_pass"] == "grpc://specdec_verifiers" and shipped["listen"] == "50051 http2"
    configmap = _docs()[("ConfigMap", "specdec-balancer")]["data"]["nginx.conf"]
    assert _directives(configmap) == shipped
    host = _directives((NGINX_CONF.parent / "nginx.host.conf").read_text())  # deploy/compose.host.yml's
    assert host.pop("listen").startswith("127.0.0.1:") and host == {k: v for k, v in shipped.items() if k != "listen"}
    assert re.search(r"server specdec-verifier-headless\.[\w.-]+:50051 resolve", configmap)
    balancer = _docs()[("Deployment", "specdec-balancer")]
    mount = balancer["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPath"]
    assert f"{mount}/nginx.conf" in balancer["spec"]["template"]["spec"]["containers"][0]["args"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert {"verifier", "verifier-b", "balancer", "redis"} <= set(compose)
    assert any(v.startswith("./deploy/nginx/nginx.conf:") for v in compose["balancer"]["volumes"])
    upstreams = re.findall(r"^\s*server ([\w.-]+):50051", NGINX_CONF.read_text(), re.M)
    assert sorted(upstreams) == ["verifier", "verifier-b"]  # the compose services
    ids = {compose[s]["environment"]["SPECDEC_VERIFIER_ID"] for s in ("verifier", "verifier-b")}
    assert len(ids) == 2


def test_nginx_accepts_the_shipped_config(tmp_path):
    """`nginx -t` on deploy/nginx/nginx.conf as the balancer test runs it (local addresses, temp paths)."""
    import subprocess

    from _cluster import nginx_binary, render_nginx_conf

    binary = nginx_binary()
    if binary is None:
        pytest.skip("no nginx binary found: install the Debian package nginx-light (see .ci/run)")
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_nginx_conf(["127.0.0.1:1", "127.0.0.1:2"], 1, tmp_path))
    run = subprocess.run([binary, "-t", "-c", str(conf), "-p", str(tmp_path), "-g", "daemon off;"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
