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


def test_the_cache_does_not_import_the_transport_or_the_services() -> None:
    probe = (
        "import sys, sdcp.cache, pkgutil, importlib\n"
        "for m in pkgutil.walk_packages(sdcp.cache.__path__, 'sdcp.cache.'):\n"
        "    importlib.import_module(m.name)\n"
        "print('\\n'.join(sorted(n for n in sys.modules if n.startswith('sdcp.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    layers = {name.split(".")[1] for name in out.stdout.split()}
    above = layers & {"transport", "services", "models", "bench", "cluster", "cli", "client"}
    assert not above, f"sdcp.cache pulled in {sorted(above)}"
