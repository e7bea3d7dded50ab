"""A host runs only its role: a router or a gateway starts where torch, transformers and the other
model packages cannot be imported (they are the verifier's and drafter's extras, pyproject.toml)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from tests.waiting import HANG_GUARD_S

from sdcp.bench.workloads import WORKLOADS
from sdcp.localhost import free_port
from sdcp.models.hf import tiny
from sdcp.transport.certs import instance_name, make_certs

# Installed with the verifier, drafter and bench extras only.
MODEL_PACKAGES = ("torch", "transformers", "safetensors", "gguf", "accelerate", "llama_cpp", "matplotlib")

# Runs `python -m sdcp ...` (or a snippet) with those packages made unimportable.
BLOCKED = textwrap.dedent(
    f"""
    import importlib.abc, runpy, sys

    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {MODEL_PACKAGES!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Absent())
    if sys.argv[1] == "-c":
        exec(sys.argv[2])
    else:
        sys.argv = ["sdcp", *sys.argv[1:]]
        runpy.run_module("sdcp", run_name="__main__")
    """
)


def without_models(*args: str, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", BLOCKED, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def test_the_router_and_gateway_modules_import_no_model_package() -> None:
    snippet = (
        "import sdcp.services.router, sdcp.frontend.gateway, sdcp.services.mlc, sdcp.cli\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {MODEL_PACKAGES!r})\n"
        "assert not loaded, loaded\n"
    )
    process = without_models("-c", snippet)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output.decode()


def _config(tmp_path: Path, uri: str, role_lines: str, admin: int) -> Path:
    stem = instance_name(uri)
    path = tmp_path / f"{stem}.toml"
    path.write_text(
        f'[instance]\nuri = "{uri}"\ncert = "certs/{stem}.pem"\nkey = "certs/{stem}.key"\nca = "certs/ca.pem"\n'
        f'router = "https://127.0.0.1:{free_port()}"\n\n[admin]\nlisten = "127.0.0.1:{admin}"\n{role_lines}',
        encoding="utf-8",
    )
    return path


def _tokenizer_only_model(directory: Path) -> Path:
    """A model directory with the tokenizer files alone, as a gateway host holds them."""
    directory.mkdir()
    tiny.tiny_tokenizer().backend_tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": tiny.END_OF_TEXT}))
    (directory / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return directory


@pytest.mark.parametrize("role", ["router", "gateway"])
def test_a_router_or_gateway_serves_without_torch(tmp_path: Path, role: str) -> None:
    uri = f"https://127.0.0.1:{free_port()}"
    make_certs(tmp_path / "certs", [uri])
    admin = free_port()
    lines = ""
    if role == "gateway":
        model = _tokenizer_only_model(tmp_path / "model")
        lines = f'\n[gateway]\nlisten = "127.0.0.1:{free_port()}"\nmodel = "{model}"\n'
    process = without_models(role, "--config", str(_config(tmp_path, uri, lines, admin)), cwd=tmp_path)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            assert process.poll() is None, process.communicate()[0].decode()
            try:
                health = httpx.get(f"http://127.0.0.1:{admin}/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, f"the {role} did not start"
                time.sleep(0.2)
        assert health.status_code == 200 and health.json()["role"] == role
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_verifier_without_its_extra_says_what_to_install(tmp_path: Path) -> None:
    uri = f"https://127.0.0.1:{free_port()}"
    make_certs(tmp_path / "certs", [uri])
    config = _config(tmp_path, uri, "\n[verifier]\nmodel = 'tiny'\n", free_port())
    process = without_models("verifier", "--config", str(config), cwd=tmp_path)
    output = process.communicate(timeout=120)[0].decode()
    assert process.returncode == 1 and "Traceback" not in output
    assert "pip install 'sdcp[verifier]'" in output


def test_the_benchmark_prompts_and_the_license_ship_in_the_wheel(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            str(root),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("sdcp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for workload in WORKLOADS:
        assert f"sdcp/bench/prompts/{workload}.txt" in names
    assert any(name.endswith("licenses/LICENSE") for name in names)
