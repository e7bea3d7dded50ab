"""`sdcp up --api-key --host --served-model-name --device --dtype` (#29 item 5, #30 item 6) on one
cluster of the bundled model: the gateway on every address behind TLS and the key, the key kept for
restarts in a 0600 file and nowhere else, and options that conflict refused with one line."""

from __future__ import annotations

import os
import signal
import ssl
import stat
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from tests.e2e.homes import fresh_home
from tests.e2e.support import cluster_up, sdcp
from tests.waiting import wait_until

from sdcp.cluster import LocalCluster

pytestmark = pytest.mark.timeout(600)

KEY = "k3y-for-the-test-0123456789"
SERVED = "sdcp-chat"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = fresh_home(tmp_path_factory.mktemp("sdcp-home"))
    options = ["--host", "0.0.0.0", "--served-model-name", SERVED, "--device", "cpu", "--dtype", "float32"]
    with cluster_up(root, "--gateway-port", "0", "--api-key", KEY, *options) as started:
        assert started.returncode == 0, started.stderr
        # `sdcp up` says where the key is and which CA to trust, never the key.
        assert KEY not in started.stdout + started.stderr
        assert "API key in" in started.stderr and "TLS: trust" in started.stderr
        yield root


def api(home: Path, method: str, path: str, *, key: str | None = KEY, json: object = None) -> httpx.Response:
    """A request to the gateway over TLS, checked against the cluster's CA under the name its
    certificate carries (the machine's host name, which need not resolve here: the connection goes
    to loopback, the name is given to TLS)."""
    gateway = LocalCluster(home).gateway
    assert gateway is not None and gateway.startswith("https://")
    parts = urlsplit(gateway)
    context = ssl.create_default_context(cafile=str(home / "cluster" / "certs" / "ca.pem"))
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    with httpx.Client(verify=context, timeout=120) as client:
        return client.request(
            method,
            f"https://127.0.0.1:{parts.port}{parts.path}/{path}",
            headers=headers,
            json=json,
            extensions={"sni_hostname": parts.hostname},
        )


def test_the_gateway_serves_the_served_name_behind_tls_and_the_key(home: Path) -> None:
    assert api(home, "GET", "models", key=None).status_code == 401
    assert api(home, "GET", "models", key="wrong").status_code == 401
    # The endpoints added for the client libraries ask for the key as well.
    assert api(home, "GET", f"models/{SERVED}", key=None).status_code == 401
    assert api(home, "POST", "responses", key="wrong", json={"model": SERVED, "input": "Hi"}).status_code == 401
    assert api(home, "GET", f"models/{SERVED}").json()["id"] == SERVED
    models = api(home, "GET", "models")
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [SERVED]
    body = {"model": SERVED, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    answer = api(home, "POST", "completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == SERVED and answer.json()["choices"][0]["text"]
    # The name the model has on disk is not the one served.
    assert api(home, "POST", "completions", json={**body, "model": "smollm2"}).status_code == 404


def test_the_key_is_kept_in_a_0600_file_and_nowhere_else(home: Path) -> None:
    cluster = LocalCluster(home)
    assert stat.S_IMODE(cluster.api_key_file.stat().st_mode) == 0o600
    assert cluster.api_key_file.read_text().strip() == KEY
    root = home / "cluster"
    gateway_toml = (root / "gateway.toml").read_text()
    assert 'api_key_file = "api-key"' in gateway_toml and f'served_model_name = "{SERVED}"' in gateway_toml
    assert 'listen = "0.0.0.0:' in gateway_toml and "cert = " in gateway_toml
    verifier_toml = (root / "verifier.toml").read_text()
    assert 'device = "cpu"' in verifier_toml and 'dtype = "float32"' in verifier_toml
    status = sdcp(home, "status")
    assert status.returncode == 0 and KEY not in status.stdout + status.stderr
    # Neither in a file of the cluster but its own (configurations, state, logs), nor in the
    # command line or environment of an instance.
    for path in root.rglob("*"):
        if path.is_file() and path != cluster.api_key_file and path.suffix != ".key":
            assert KEY.encode() not in path.read_bytes(), path
    for instance in cluster.instances():
        for name in ("cmdline", "environ"):
            assert KEY.encode() not in Path(f"/proc/{instance.pid}/{name}").read_bytes(), (instance.name, name)


def test_a_restart_keeps_the_key_and_other_options_are_one_line_errors(home: Path) -> None:
    cluster = LocalCluster(home)
    # On the CPU, `sdcp up` runs every instance in one process: the gateway's is the verifier's.
    assert len({instance.pid for instance in cluster.instances()}) == 1
    gateway = next(instance for instance in cluster.instances() if instance.role == "gateway")
    os.kill(gateway.pid, signal.SIGKILL)
    wait_until(lambda: not gateway.alive(), what="the gateway gone")
    # The options it runs with are not a conflict; the key comes from the cluster's file.
    restarted = sdcp(home, "up", "--served-model-name", SERVED)
    assert restarted.returncode == 0, restarted.stderr
    again = next(instance for instance in cluster.instances() if instance.role == "gateway")
    assert again.pid != gateway.pid and again.uri == gateway.uri
    assert api(home, "GET", "models", key=None).status_code == 401
    assert api(home, "GET", "models").status_code == 200
    for options, message in [
        (["--api-key", "another"], "the cluster runs with another API key"),
        (["--dtype", "bfloat16"], "the cluster runs with --dtype float32, not bfloat16"),
        (["--host", "127.0.0.1"], "the cluster runs with --host 0.0.0.0, not 127.0.0.1"),
        (["--served-model-name", "other"], f"the cluster runs with --served-model-name {SERVED}, not other"),
        (["--processes"], "the cluster runs with --one-process, not --processes"),
    ]:
        refused = sdcp(home, "up", *options)
        assert refused.returncode == 1 and message in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--host", "0.0.0.0"], "--host 0.0.0.0 serves the API beyond this machine: give --api-key too"),
        (["--backend", "llamacpp", "--device", "cuda"], "--backend llamacpp runs on the cpu, not on cuda"),
        (["--backend", "llamacpp", "--dtype", "bfloat16"], "--backend llamacpp runs the GGUF's own types"),
        (["--device", "tpu"], "--device tpu is none of cpu, cuda, cuda:N, mps"),
    ],
)
def test_options_that_cannot_go_together_are_one_line_before_anything_starts(
    empty_home: Path, options: list[str], message: str
) -> None:
    refused = sdcp(empty_home, "up", "--gateway-port", "0", *options)
    assert refused.returncode == 1 and message in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    assert LocalCluster(empty_home).instances() == [] and not (empty_home / "cluster" / "logs").exists()
