"""Architecture guard: the protocol core stays sans-IO (DESIGN.md section 1)."""

import subprocess
import sys

ALLOWED_THIRD_PARTY = {"cbor2", "numpy"}


def test_protocol_imports_only_stdlib_cbor2_numpy() -> None:
    probe = (
        "import sys, sdcp.protocol, pkgutil, importlib\n"
        "for m in pkgutil.walk_packages(sdcp.protocol.__path__, 'sdcp.protocol.'):\n"
        "    importlib.import_module(m.name)\n"
        "print('\\n'.join(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(out.stdout.split())
    foreign = {
        name
        for name in loaded - ALLOWED_THIRD_PARTY - {"sdcp"}
        if name not in sys.stdlib_module_names and not name.startswith("_")
    }
    assert foreign == set(), f"sdcp.protocol pulled in {sorted(foreign)}"
    assert "torch" not in loaded and "asyncio" not in loaded
