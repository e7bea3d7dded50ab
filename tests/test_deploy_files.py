"""deploy/: the Dockerfile passes hadolint, the Kubernetes manifests validate against the API's schemas
(strict), and what they hold is a working sdcp deployment: every instance's TOML loads, every pod
finds its TOML, its certificates and probes on the admin listener it configures."""

from __future__ import annotations

import base64
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client import REGISTRY

from sdcp.config import load_config
from sdcp.services.authz import Party, Trust
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
    for workload in ("router", "gateway", "verifier-0", "verifier-1", "drafter-0", "drafter-1"):
        assert ("Deployment", workload) in kinds
    for service in ("router", "gateway", "verifier", "drafter", "redis"):
        assert ("Service", service) in kinds
    assert ("StatefulSet", "redis") in kinds
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
    trust = Trust.from_config(router, "router")
    # The router's trust patterns admit every verifier and drafter in its role, and only in it.
    for name, config in configs.items():
        uri = config.instance.uri
        assert trust.is_member(uri, Party.VERIFIER) == name.startswith("verifier-"), name
        assert trust.is_member(uri, Party.DRAFTER) == name.startswith("drafter-"), name
    assert configs["gateway.toml"].instance.uri in router.trust.front_ends
    assert all(c.instance.router == router.instance.uri for c in configs.values())
    # The gateway reads its API key from the Secret the pod mounts, not from its environment.
    assert configs["gateway.toml"].gateway.api_key_file == Path("/etc/sdcp/api-key/api-key")
    # Every verifier names its backend: they all run one target, and none measures at start.
    assert {c.verifier.backend for n, c in configs.items() if n.startswith("verifier-")} == {"torch"}


def _pods() -> list[tuple[str, dict[str, Any]]]:
    """(workload name, pod spec) of every Deployment and StatefulSet but Redis."""
    workloads = of_kind("Deployment") + of_kind("StatefulSet")
    return [
        (w["metadata"]["name"], w["spec"]["template"]["spec"]) for w in workloads if w["metadata"]["name"] != "redis"
    ]


def test_each_pod_finds_its_configuration_certificates_and_probes() -> None:
    files = config_files()
    pods = dict(_pods())
    assert set(pods) == {"router", "gateway", "verifier-0", "verifier-1", "drafter-0", "drafter-1"}
    workloads = {w["metadata"]["name"]: w for w in of_kind("Deployment")}
    for name, pod in pods.items():
        (container,) = pod["containers"]
        role, flag, path = container["args"][:3]
        assert role == name.split("-")[0] and flag == "--config" and path == f"/etc/sdcp/config/{name}.toml"
        text = files[f"{name}.toml"]
        admin_port = int(re.search(r'\[admin\]\nlisten = "[^:]+:(\d+)"', text).group(1))  # type: ignore[union-attr]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["admin"] == admin_port
        cert = re.search(r'^cert = "/etc/sdcp/certs/([^"]+)\.pem"', text, re.MULTILINE).group(1)  # type: ignore[union-attr]
        uri = re.search(r'^uri = "([^"]+)"', text, re.MULTILINE).group(1)  # type: ignore[union-attr]
        assert cert == instance_name(uri)
        assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "admin"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "admin"}
        if role in ("verifier", "drafter"):
            # The host of its URI is the pod's own name under its role's headless Service, and
            # never two pods of one identity at once.
            assert urlsplit(uri).hostname == f"{pod['hostname']}.{pod['subdomain']}.sdcp.svc.cluster.local"
            assert pod["hostname"] == name and pod["subdomain"] == role
            spec = workloads[name]["spec"]
            assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}


def _secrets(tmp_path: Path, *identities: str) -> dict[str, dict[str, bytes]]:
    """make-secrets.sh run as a user runs it: the Secrets it prints, name -> file -> content."""
    env = {**os.environ, "PATH": f"{TOOLS}{os.pathsep}{os.environ['PATH']}"}
    script = DEPLOY / "kubernetes" / "make-secrets.sh"
    result = subprocess.run(
        ["bash", str(script), str(tmp_path / "certs"), *identities],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    secrets = {}
    for doc in yaml.safe_load_all(result.stdout):
        if doc:
            assert doc["kind"] == "Secret" and doc["metadata"]["namespace"] == "sdcp"
            secrets[doc["metadata"]["name"]] = {k: base64.b64decode(v) for k, v in doc["data"].items()}
    return secrets


def _identity(pem: bytes) -> str:
    (uri,) = (
        x509.load_pem_x509_certificate(pem)
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value.get_values_for_type(x509.UniformResourceIdentifier)
    )
    return str(uri)


def _same_key(cert_pem: bytes, key_pem: bytes) -> bool:
    public = x509.load_pem_x509_certificate(cert_pem).public_key()
    private = serialization.load_pem_private_key(key_pem, password=None)
    der = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return bool(public.public_bytes(*der) == private.public_key().public_bytes(*der))


def test_no_pod_mounts_a_key_that_is_not_its_own(tmp_path: Path) -> None:
    """#29: each pod mounts the CA's certificate and its own identity's certificate and key, and no
    other private key (a verifier holding another's key could pose as it). The Secrets are those
    make-secrets.sh prints; the TOML of the pod names the same identity."""
    secrets = _secrets(tmp_path)
    files = config_files()
    assert set(secrets["sdcp-ca"]) == {"ca.pem"}  # the CA's key stays with whoever issues
    assert set(secrets["sdcp-gateway-api-key"]) == {"api-key"} and len(secrets["sdcp-gateway-api-key"]["api-key"]) > 32
    for name, pod in _pods():
        uri = re.search(r'^uri = "([^"]+)"', files[f"{name}.toml"], re.MULTILINE).group(1)  # type: ignore[union-attr]
        mounted: dict[str, bytes] = {}
        for volume in pod["volumes"]:
            sources = volume.get("projected", {}).get("sources", [])
            names = [source["secret"]["name"] for source in sources if "secret" in source]
            if "secret" in volume:
                names.append(volume["secret"]["secretName"])
            for secret in names:
                mounted.update(secrets[secret])
        keys = [file for file, content in mounted.items() if b"PRIVATE KEY" in content]
        assert keys == [f"{instance_name(uri)}.key"], (name, keys)
        cert = mounted[f"{instance_name(uri)}.pem"]
        assert _identity(cert) == uri and _same_key(cert, mounted[keys[0]]), name


def test_an_instance_is_added_with_one_new_certificate(tmp_path: Path) -> None:
    """docs/deploy.md, "Adding instances": make-secrets.sh with the new identity's name prints its
    Secret only, signed by the CA already there; no other certificate changes, and the router's
    trust pattern admits it without an edit."""
    before = _secrets(tmp_path)
    added = _secrets(tmp_path, "verifier-2")
    assert set(added) == {"sdcp-verifier-2"}
    after = {path.name: path.read_bytes() for path in (tmp_path / "certs").glob("*.pem")}
    for secret in before.values():
        for file, content in secret.items():
            if file.endswith(".pem"):
                assert after[file] == content, file
    new_cert = added["sdcp-verifier-2"]["verifier-2.verifier.sdcp.svc.cluster.local_8443.pem"]
    issued = x509.load_pem_x509_certificate(new_cert)
    issued.verify_directly_issued_by(x509.load_pem_x509_certificate(before["sdcp-ca"]["ca.pem"]))
    uri = _identity(new_cert)
    assert uri == "https://verifier-2.verifier.sdcp.svc.cluster.local:8443"
    config_path = tmp_path / "router.toml"
    config_path.write_text(config_files()["router.toml"].replace("/etc/sdcp/certs/", f"{tmp_path}/certs/"))
    assert Trust.from_config(load_config(config_path), "router").is_member(uri, Party.VERIFIER)


def test_no_pod_downloads_the_model_at_start() -> None:
    """#29: the model is a layer of the image, converted once when it is built; pods have no init
    container, no command that fetches, and no volume the model would be written to."""
    for name, pod in _pods():
        assert "initContainers" not in pod, name
        for container in pod["containers"]:
            assert "fetch" not in container["args"] and container["image"] in ("sdcp:full", "sdcp:slim"), name
        writable = [v["name"] for v in pod["volumes"] if "emptyDir" in v or "persistentVolumeClaim" in v]
        assert not writable, name
    for workload in of_kind("StatefulSet"):
        assert workload["metadata"]["name"] == "redis"  # the only one that claims a volume
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "sdcp models fetch" in dockerfile and "COPY --from=model" in dockerfile


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
    for workload, pod in _pods():
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
    for module in ("sdcp.engines.verifier", "sdcp.engines.drafter", "sdcp.services.router", "sdcp.frontend.gateway"):
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


def test_each_role_reaches_redis_as_its_own_user(tmp_path: Path) -> None:
    """#29, docs/security.md "Store credentials per role": Redis loads the ACL file of the Secret
    sdcp-redis-acl (default user off, a user per role with the rules of sdcp.cache.redis_acl, the
    passwords hashed), and each pod mounts the password of its own role's user only, the one its
    TOML names."""
    import hashlib

    from sdcp.cache.redis_acl import DEFAULT_USER, acl_rules

    secrets = _secrets(tmp_path)
    acl = secrets["sdcp-redis-acl"]["users.acl"].decode()
    lines = {line.split()[1]: line.split() for line in acl.splitlines()}
    assert lines["default"] == DEFAULT_USER.split() and lines["default"][2] == "off"
    (redis,) = (w for w in of_kind("StatefulSet") if w["metadata"]["name"] == "redis")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["args"][-2:] == ["--aclfile", "/etc/redis/acl/users.acl"]
    for role in ("router", "verifier", "drafter", "admin"):
        password = secrets[f"sdcp-redis-{role}"]["password"].decode().strip()
        assert password.encode() not in secrets["sdcp-redis-acl"]["users.acl"]
        user = lines[f"sdcp-{role}"]
        assert user[2:4] == ["on", f"#{hashlib.sha256(password.encode()).hexdigest()}"]
        assert user[4:] == " ".join(acl_rules(role, "sdcp:mlc:")).split()
    files = config_files()
    for name, pod in _pods():
        role = name.split("-")[0]
        mounted = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        if role == "gateway":  # reaches no store
            assert not [m for m in mounted if m.startswith("sdcp-redis-")] and "redis_url" not in files["gateway.toml"]
            continue
        assert [m for m in mounted if m.startswith("sdcp-redis-")] == [f"sdcp-redis-{role}"], name
        text = files[f"{name}.toml"]
        assert f'redis_username = "sdcp-{role}"' in text and 'redis_password_file = "/etc/sdcp/redis/password"' in text
        (container,) = pod["containers"]
        assert {"name": "redis", "mountPath": "/etc/sdcp/redis", "readOnly": True} in container["volumeMounts"]
