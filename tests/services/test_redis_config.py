"""[mlc] Redis credentials and `sdcp redis-acl` (docs/deploy.md, docs/security.md "Store credentials
per role"): the password comes from a file and shows in no repr or output; TLS files need rediss://."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdcp.config import ConfigError, load_config


def write_config(tmp_path: Path, mlc: str) -> Path:
    path = tmp_path / "verifier.toml"
    instance = '[instance]\nuri = "https://127.0.0.1:9101"\ncert = "c.pem"\nkey = "c.key"\nca = "ca.pem"\n'
    path.write_text(f"{instance}\n[mlc]\n{mlc}\n")
    return path


def test_the_password_comes_from_its_file_and_shows_nowhere(tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "verifier.password").write_text("s3cret-pw\n")
    config = load_config(
        write_config(
            tmp_path,
            'redis_url = "redis://default:url-pw@127.0.0.1:6379/0"\nredis_username = "sdcp-verifier"\n'
            'redis_password_file = "redis/verifier.password"',
        )
    )
    access = config.mlc.redis_access("verifier")
    assert (access.role, access.username, access.password) == ("verifier", "sdcp-verifier", "s3cret-pw")
    assert "s3cret-pw" not in repr(access) and "url-pw" not in repr(config)


def test_an_empty_or_missing_password_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    for name in ("empty", "missing"):
        config = load_config(write_config(tmp_path, f'redis_url = "redis://h:1/0"\nredis_password_file = "{name}"'))
        with pytest.raises(ConfigError, match="redis_password_file"):
            config.mlc.redis_access("verifier")


def test_tls_files_need_a_rediss_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rediss://"):
        load_config(write_config(tmp_path, 'redis_url = "redis://h:1/0"\nredis_ca = "ca.pem"'))
    config = load_config(write_config(tmp_path, 'redis_url = "rediss://h:1/0"\nredis_ca = "ca.pem"'))
    assert config.mlc.redis_access(None).ca == str(tmp_path / "ca.pem")


def test_sdcp_redis_acl_writes_private_files_and_prints_no_password(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "sdcp", "redis-acl", "--secrets", str(tmp_path / "s")]
    result = subprocess.run(
        [*command, "--acl-file", str(tmp_path / "users.acl"), "--role", "drafter", "--role", "admin"],
        capture_output=True,
        text=True,
        env={**os.environ, "SDCP_HOME": str(tmp_path)},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    password = (tmp_path / "s" / "drafter.password").read_text().strip()
    assert password not in result.stdout + result.stderr and "sdcp-drafter" in result.stdout
    for path in (tmp_path / "users.acl", tmp_path / "s" / "drafter.password"):
        assert path.stat().st_mode & 0o777 == 0o600
    acl = (tmp_path / "users.acl").read_text()
    assert password not in acl and "user default off" in acl and "user sdcp-drafter on #" in acl
