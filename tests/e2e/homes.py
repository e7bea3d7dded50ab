"""SDCP homes for the end-to-end tests: `fresh_home` makes a directory an SDCP home whose model cache
is the one `make test` fetched, so that each test's cluster starts from an empty home without
fetching or converting the model again. tests/e2e/conftest.py builds its `home` and `empty_home`
fixtures on it; tests that start clusters of their own shape call it directly."""

from __future__ import annotations

from pathlib import Path

from sdcp.home import sdcp_home


def fresh_home(root: Path) -> Path:
    """An SDCP home whose model cache is the one `make test` fetched."""
    (root / "models").symlink_to(sdcp_home() / "models", target_is_directory=True)
    return root
