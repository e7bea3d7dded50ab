"""docs/wire.md is what the code writes (python -m sdcp.wiredoc docs/wire.md regenerates it)."""

from __future__ import annotations

from pathlib import Path

from sdcp.protocol import codec
from sdcp.wiredoc import diagnostic, render

WIRE_MD = Path(__file__).resolve().parent.parent / "docs" / "wire.md"


def test_docs_wire_md_is_generated_from_the_code() -> None:
    assert WIRE_MD.read_text(encoding="utf-8") == render(), "run: python -m sdcp.wiredoc docs/wire.md"


def test_diagnostic_notation_follows_rfc_8949_section_8() -> None:
    value = codec.decode(bytes.fromhex("a2616183010203616282f5f6"))
    assert diagnostic(value) == '{"a": [1, 2, 3], "b": [true, null]}'
    assert diagnostic(b"\x01\xff") == "h'01ff'"
