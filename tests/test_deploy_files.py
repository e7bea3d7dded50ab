"""deploy/: the Dockerfile passes hadolint, the Kubernetes manifests validate against the API's schemas
(strict), and what they hold is a working sdcp deployment: every instance's TOML loads, every pod
finds its TOML, its certificates and probes on the admin listener it configures."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from sdcp.config import load_config
from sdcp.transport.certs import instance_name, make_certs

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
TOOLS = Path(sys.executable).parent


def run_tool(name: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TOOLS / name), *map(str, args)], capture_output=True, text=True, check=False)


def documents() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents() if doc["kind"] == kind]


def config_files() -> dict[str, str]:
    (config_map,) = (d for d in of_kind("ConfigMap") if d["metadata"]["name"] == "sdcp-config")
    data: dict[str, str] = config_map["data"]
    return data


def test_the_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    result = run_tool("hadolint", DEPLOY / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr
    # The same check refuses a Dockerfile that breaks its rules: it really runs.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /src && pip install .\n")
    assert run_tool("hadolint", bad).returncode != 0


def test_the_manifests_validate_strictly(tmp_path: Path) -> None:
    result = run_tool("kubernetes-validate", "--strict", *MANIFESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in documents()}
    for workload in ("router", "gateway"):
        assert ("Deployment", workload) in kinds and ("Service", workload) in kinds
    for workload in ("verifier", "drafter", "redis"):
        assert ("StatefulSet", workload) in kinds and ("Service", workload) in kinds
    broken = tmp_path / "router.yaml"
    broken.write_text((DEPLOY / "kubernetes" / "router.yaml").read_text().replace("replicas: 1", "replicas: one"))
    assert run_tool("kubernetes-validate", "--strict", broken).returncode != 0


def test_every_instance_configuration_loads(tmp_path: Path) -> None:
    files = config_files()
    uris = [re.search(r'^uri = "([^"]+)"', text, re.MULTILINE).group(1) for text in files.values()]  # type: ignore[union-attr]
    make_certs(tmp_path / "certs", uris)
    shutil.copy(tmp_path / "certs" / "ca.pem", tmp_path / "ca.pem")
    configs = {}
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text.replace("/etc/sdcp/certs/", f"{tmp_path}/certs/"))
        configs[name] = load_config(path)
    router = configs["router.toml"]
    verifiers = {c.instance.uri for n, c in configs.items() if n.startswith("verifier-")}
    drafters = {c.instance.uri for n, c in configs.items() if n.startswith("drafter-")}
    assert set(router.trust.verifiers) == verifiers and set(router.trust.drafters) == drafters
    assert configs["gateway.toml"].instance.uri in router.trust.front_ends
    assert all(c.instance.router == router.instance.uri for c in configs.values())
    # The certificates make-secrets.sh issues are those the configurations name.
    script = (DEPLOY / "kubernetes" / "make-secrets.sh").read_text()
    for uri in uris:
        assert uri.replace("sdcp.svc.cluster.local", "$domain") in script


def _pods() -> list[tuple[str, int, dict[str, Any]]]:
    """(workload name, replicas, pod spec) of every Deployment and StatefulSet but Redis."""
    workloads = of_kind("Deployment") + of_kind("StatefulSet")
    return [
        (w["metadata"]["name"], w["spec"]["replicas"], w["spec"]["template"]["spec"])
        for w in workloads
        if w["metadata"]["name"] != "redis"
    ]


@pytest.mark.parametrize("workload", ["router", "verifier", "drafter", "gateway"])
def test_each_pod_finds_its_configuration_certificates_and_probes(workload: str) -> None:
    files = config_files()
    ((name, replicas, pod),) = [p for p in _pods() if p[0] == workload]
    (container,) = pod["containers"]
    role, flag, path = container["args"][:3]
    assert role == workload and flag == "--config"
    pod_names = [f"{name}-{index}" for index in range(replicas)]
    wanted = [path.replace("$(POD_NAME)", pod) for pod in pod_names] if "$(POD_NAME)" in path else [path]
    for config_path in wanted:
        key = config_path.removeprefix("/etc/sdcp/config/")
        assert key in files, f"{config_path} is not in the ConfigMap"
        text = files[key]
        admin_port = int(re.search(r'\[admin\]\nlisten = "[^:]+:(\d+)"', text).group(1))  # type: ignore[union-attr]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["admin"] == admin_port
        cert = re.search(r'^cert = "/etc/sdcp/certs/([^"]+)\.pem"', text, re.MULTILINE).group(1)  # type: ignore[union-attr]
        uri = re.search(r'^uri = "([^"]+)"', text, re.MULTILINE).group(1)  # type: ignore[union-attr]
        assert cert == instance_name(uri)
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "admin"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "admin"}
    (certs,) = [v for v in pod["volumes"] if v["name"] == "certs"]
    secrets = {source["secret"]["name"] for source in certs["projected"]["sources"]}
    assert secrets == {"sdcp-ca", f"sdcp-{workload}"}


def test_the_admin_port_is_on_no_service_and_only_prometheus_reaches_it() -> None:
    """docs/security.md, "Admin listeners": the admin listener asks for no credentials, so it is
    for the kubelet's probes and Prometheus only: on no Service, and a NetworkPolicy admits to it
    only Prometheus, while every other port of the pods stays reachable by whom it serves."""
    for service in of_kind("Service"):
        ports = service["spec"]["ports"]
        assert all(p["name"] != "admin" and p["port"] != 9000 for p in ports), service["metadata"]["name"]
    (policy,) = of_kind("NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "sdcp"}}
    assert spec["policyTypes"] == ["Ingress"]
    reaching = {port["port"]: rule.get("from") for rule in spec["ingress"] for port in rule["ports"]}
    ((prometheus,),) = [reaching[9000]]
    assert prometheus["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert "namespaceSelector" in prometheus
    own_pods = [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "sdcp"}}}]
    assert reaching[8443] == own_pods and reaching[6379] == own_pods and reaching[8000] is None
    for workload, _, pod in _pods():
        (container,) = pod["containers"]
        ports = {p["containerPort"] for p in container["ports"]}
        assert ports <= set(reaching), workload
    for workload in of_kind("Deployment") + of_kind("StatefulSet"):
        if workload["metadata"]["name"] == "redis":
            continue
        template = workload["spec"]["template"]["metadata"]
        assert template["labels"]["app.kubernetes.io/name"] == "sdcp"
        assert template["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": "9000",
            "prometheus.io/path": "/metrics",
        }


def test_the_grafana_dashboard_queries_metrics_that_exist() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "sdcp.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(exprs) >= 20
    # Import every module that defines metrics, then read the registry: each name a query uses is one
    # of ours (a counter's samples end in _total, a histogram's in _bucket).
    for module in ("sdcp.engines.verifier", "sdcp.engines.drafter", "sdcp.services.router", "sdcp.services.gateway"):
        importlib.import_module(module)
    names = {sample for family in REGISTRY.collect() for sample in _sample_names(family)}
    used = {name for expr in exprs for name in re.findall(r"\b(sdcp[_:][a-z0-9_:]+)", expr)}
    assert used and used <= names, sorted(used - names)
    documented = (DEPLOY.parent / "docs" / "observability.md").read_text()
    for name in used:
        family = re.sub(r"_(total|bucket|count|sum)$", "", name)
        assert family in documented, f"{family} is not in docs/observability.md"


def _sample_names(family: Any) -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
