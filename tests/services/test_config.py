"""Configuration files: every key is checked, with a message naming it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sdcp.cache import UnresolvableRef
from sdcp.cli import app
from sdcp.config import ConfigError, DrafterConfig, VerifierConfig, load_config
from sdcp.services.node import build_mlc
from sdcp.transport.certs import make_certs

INSTANCE = """
[instance]
uri = "https://127.0.0.1:9101"
cert = "certs/a.pem"
key = "certs/a.key"
ca = "certs/ca.pem"
"""


def _write(tmp_path: Path, verifier: str) -> Path:
    path = tmp_path / "verifier.toml"
    path.write_text(INSTANCE + "\n[verifier]\n" + verifier, encoding="utf-8")
    return path


def test_verifier_keys_are_read(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "model = 'tiny'\nkv_slots = 8\nkv_capacity = 1024\nidle_timeout_s = 60\n"))
    assert (config.verifier.kv_slots, config.verifier.kv_capacity, config.verifier.idle_timeout_s) == (8, 1024, 60)
    assert config.instance.cert == tmp_path / "certs" / "a.pem"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("publish_kv_every = 4", "unknown key verifier.publish_kv_every"),
        ("kv_slots = 1.5", "verifier.kv_slots must be an integer"),
        ("kv_slots = -1", "verifier.kv_slots must not be negative"),
        ("idle_timeout_s = -5.0", "verifier.idle_timeout_s must not be negative"),
        ("idle_timeout_s = 'soon'", "verifier.idle_timeout_s must be a number"),
        ("max_batch = 0", "verifier.max_batch must be at least 1"),
    ],
)
def test_bad_verifier_keys_are_named(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, line + "\n"))


@pytest.mark.parametrize(
    ("section", "line", "message"),
    [
        ("instance", "ttl_ms = 0", "instance.ttl_ms must be at least 1"),
        ("drafter", "lease_s = 0", "drafter.lease_s must be positive"),
        ("router", "m_init = 0", "router.m_init must be at least 1"),
    ],
)
def test_values_that_would_spin_or_never_hold_are_refused(
    tmp_path: Path, section: str, line: str, message: str
) -> None:
    text = INSTANCE.replace("[instance]", f"[instance]\n{line}") if section == "instance" else INSTANCE
    if section != "instance":
        text += f"\n[{section}]\n{line}\n"
    path = tmp_path / "instance.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_gateway_without_a_router_is_a_one_line_cli_error(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(INSTANCE + "\n[gateway]\nmodel = 'tiny'\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["gateway", "--config", str(path)])
    assert result.exit_code == 1
    assert "the gateway needs instance.router" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cache]\nsize = 1\n", r"unknown section \[cache\]"),
        ("[verifier]\nkv_slots = true\n", "verifier.kv_slots must be an integer"),
        ("[verifier]\noutput_wait_s = '10'\n", "verifier.output_wait_s must be a number"),
        ("[trust]\ndrafters = 'https://a:1'\n", "trust.drafters must be a list of strings"),
        ("[trust]\ndrafters = [1]\n", "trust.drafters must be a list of strings"),
        ("[trust]\ndrafters = ['http://a:1']\n", "trust.drafters must be an https URI"),
        # A pattern's * stays within the leftmost label of the host, and a label follows it.
        ("[trust]\nverifiers = ['https://v-*:1']\n", "trust.verifiers a pattern is an https URI with one"),
        ("[trust]\nverifiers = ['https://a.*.b:1']\n", "trust.verifiers a pattern is an https URI with one"),
        ("[trust]\nverifiers = ['https://v-*.b:1/*']\n", "trust.verifiers a pattern is an https URI with one"),
        ("[trust]\nverifiers = ['https://v_*.b:1']\n", "trust.verifiers a pattern is an https URI with one"),
        ("[mlc]\nmlc_url = 'redis://x'\n", "mlc.mlc_url must be an https URI"),
        ("[mlc.authorities]\n'cache-b' = 'redis://x'\n", "mlc.authorities.cache-b must be an https URI"),
        ("[mlc]\nunlisted = 'proxy'\n", "mlc.unlisted"),
        ("[gateway]\nlisten = '8000'\n", "gateway.listen must be host:port"),
        ("[drafter]\npredraft = 'no'\n", "drafter.predraft must be true or false"),
        ("[drafter]\npredraft = 0\n", "drafter.predraft must be true or false"),
        ("verifier = 3\n", r"\[verifier\] must be a table"),
    ],
)
def test_every_error_is_one_line_naming_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "instance.toml"
    path.write_text(text + INSTANCE if not text.startswith("[") else INSTANCE + "\n" + text, encoding="utf-8")
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)


def test_a_missing_instance_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "instance.toml"
    path.write_text(INSTANCE.replace('ca = "certs/ca.pem"\n', ""), encoding="utf-8")
    with pytest.raises(ConfigError, match="instance.ca is required"):
        load_config(path)


def test_sections_built_in_code_are_checked_too() -> None:
    with pytest.raises(ValueError, match="greater than 0"):
        DrafterConfig(lease_s=0)
    assert dataclasses.replace(VerifierConfig(), max_batch=4).max_batch == 4
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        dataclasses.replace(VerifierConfig(), max_batch=0)


def test_cache_ref_authorities_build_the_instance_mlc(tmp_path: Path) -> None:
    issued = make_certs(tmp_path / "certs", ["https://127.0.0.1:9101"])["https://127.0.0.1:9101"]
    issued.cert_path.rename(tmp_path / "certs" / "a.pem")
    issued.key_path.rename(tmp_path / "certs" / "a.key")
    path = tmp_path / "instance.toml"
    path.write_text(
        INSTANCE + "\n[mlc]\nauthority = 'here'\nunlisted = 'refuse'\n[mlc.authorities]\n"
        "'alias' = 'own'\n'Cache-B:7000' = 'https://mlc-b.example:8450'\n",
        encoding="utf-8",
    )
    mlc = build_mlc(load_config(path))
    assert mlc.serving("mlc://alias/-/tokens/x") is mlc and mlc.serving("mlc://here/-/tokens/x") is mlc
    remote = mlc.serving("mlc://cache-b:7000/-/log/s")
    assert remote is not mlc and remote.shared.name == "remote"
    with pytest.raises(UnresolvableRef):
        mlc.serving("mlc://elsewhere/-/log/s")


def test_a_gateway_on_every_address_without_tls_is_a_one_line_cli_error(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    text = INSTANCE.replace("[instance]", "[instance]\nrouter = 'https://127.0.0.1:9'")
    path.write_text(text + "\n[gateway]\nmodel = 'tiny'\nlisten = '0.0.0.0:8000'\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["gateway", "--config", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "plain HTTP is only allowed on a loopback address" in result.output and "gateway.cert" in result.output


def test_the_api_key_file_is_read_and_an_empty_or_missing_one_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(INSTANCE + "\n[gateway]\napi_key_file = 'api-key'\nserved_model_name = 'chat'\n", encoding="utf-8")
    config = load_config(path)
    assert config.gateway.api_key_file == tmp_path / "api-key" and config.gateway.served_model_name == "chat"
    with pytest.raises(ConfigError, match="gateway.api_key_file: cannot read"):
        config.gateway.resolved_api_key()
    (tmp_path / "api-key").write_text("\n")
    with pytest.raises(ConfigError, match="holds no key"):
        config.gateway.resolved_api_key()
    (tmp_path / "api-key").write_text("s3cret\n")
    assert config.gateway.resolved_api_key() == "s3cret"
    # A key given directly (the TOML's api_key, --api-key, SDCP_API_KEY) takes precedence.
    assert dataclasses.replace(config.gateway, api_key="other").resolved_api_key() == "other"


@pytest.mark.parametrize(
    ("value", "routers"),
    [
        ("'https://r1:1'", ("https://r1:1",)),
        ("['https://r1:1', 'https://r2:2']", ("https://r1:1", "https://r2:2")),
    ],
)
def test_instance_router_is_one_router_or_a_list(tmp_path: Path, value: str, routers: tuple[str, ...]) -> None:
    path = tmp_path / "instance.toml"
    path.write_text(INSTANCE + f"router = {value}\n", encoding="utf-8")
    assert load_config(path).instance.routers == routers


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[]", "instance.router must be an https URI or a non-empty list of them"),
        ("['https://r1:1', 'https://r1:1']", "instance.router names a router twice"),
        ("['https://r1:1', 'http://r2:2']", "instance.router must be an https URI with a host"),
        ("3", "instance.router must be an https URI or a non-empty list of them"),
    ],
)
def test_a_bad_router_list_is_one_line(tmp_path: Path, value: str, message: str) -> None:
    path = tmp_path / "instance.toml"
    path.write_text(INSTANCE + f"router = {value}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        load_config(path)
