"""Architecture guards (docs/design.md, "Layers"): the protocol core stays sans-IO, the cache and the
engines stay below the transport and the services, every package has its place in docs/design.md,
and the repository cites nothing outside itself."""

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import sdcp

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "sdcp"

ALLOWED_THIRD_PARTY = {"cbor2", "numpy"}


def test_protocol_imports_only_stdlib_cbor2_numpy() -> None:
    loaded = _top_level_modules_after(
        "import sdcp.protocol, pkgutil, importlib\n"
        "for m in pkgutil.walk_packages(sdcp.protocol.__path__, 'sdcp.protocol.'):\n"
        "    importlib.import_module(m.name)\n"
    )
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
    above = layers & {"transport", "services", "frontend", "models", "bench", "cluster", "cli", "together"}
    assert not above, f"sdcp.cache pulled in {sorted(above)}"


def test_the_engines_do_not_import_the_transport_or_the_services() -> None:
    # Read, not imported: an import inside a function counts too.
    above = {"transport", "services", "frontend", "bench", "cluster", "cli", "together"}
    found = _imports_of(SRC / "engines", above)
    assert not found, f"sdcp.engines reaches above itself: {sorted(found)}"


def test_the_services_are_the_sdcp_roles_below_the_front_end() -> None:
    # The OpenAI front end builds on the roles' services (admin, listeners), never the reverse.
    found = _imports_of(SRC / "services", {"frontend", "bench", "cluster", "cli", "together"})
    assert not found, f"sdcp.services reaches above itself: {sorted(found)}"
    openai_named = sorted(p.name for p in (SRC / "services").glob("*.py") if "openai" in p.read_text(encoding="utf-8"))
    assert not openai_named, f"OpenAI API code outside sdcp.frontend: {openai_named}"


def test_a_role_imports_torch_only_to_run_a_torch_model() -> None:
    # A verifier on llama.cpp and a prompt-lookup drafter start without torch and transformers
    # (seconds of every role's start); sdcp.models.registry imports them where it loads one.
    loaded = _top_level_modules_after(
        "import sdcp.services.verifier, sdcp.services.drafter, sdcp.services.router, sdcp.frontend.gateway\n"
        "import sdcp.models.llamacpp.target, sdcp.models.llamacpp.drafter, sdcp.models.registry, sdcp.together\n"
    )
    assert {"torch", "transformers"} & loaded == set()


RUNTIME_LIBRARIES = {"hf": {"torch", "transformers"}, "llamacpp": {"llama_cpp"}, "lookup": set()}


def test_each_model_runtime_keeps_to_its_own_folder_and_library() -> None:
    # docs/design.md, models: a runtime's folder imports its own library and the shared root, never
    # another runtime's folder or library; the root's protocols and bookkeeping import none.
    runtimes = set(RUNTIME_LIBRARIES)
    for runtime, own in RUNTIME_LIBRARIES.items():
        others = set().union(*(libraries for name, libraries in RUNTIME_LIBRARIES.items() if name != runtime)) - own
        found = _top_level_imports(SRC / "models" / runtime) & others
        assert not found, f"sdcp.models.{runtime} imports another runtime's library: {sorted(found)}"
        crossing = _imports_of_modules(SRC / "models" / runtime, {f"sdcp.models.{r}" for r in runtimes - {runtime}})
        assert not crossing, f"sdcp.models.{runtime} reaches into another runtime: {sorted(crossing)}"
    for shared in ("backend.py", "drafter.py", "errors.py", "worker.py", "batching.py"):
        libraries = _top_level_imports(SRC / "models" / shared) & {"torch", "transformers", "llama_cpp"}
        assert not libraries, f"sdcp.models.{shared[:-3]} imports a runtime: {sorted(libraries)}"


def test_each_role_engine_is_a_package_whose_metrics_live_in_its_observe_module() -> None:
    # docs/design.md, engines: a facade (engine), its parts by concern, and one metrics observer per
    # engine (observe); no other engine module defines metric families.
    for role in ("verifier", "drafter", "router"):
        package = SRC / "engines" / role
        assert (package / "__init__.py").is_file() and (package / "engine.py").is_file(), role
        assert (package / "observe.py").is_file(), f"sdcp.engines.{role} has no observe module"
    defining = sorted(
        str(path.relative_to(SRC))
        for path in (SRC / "engines").rglob("*.py")
        if "prometheus_client" in _module_imports(path) and path.name != "observe.py"
    )
    assert not defining, f"metric families outside the engines' observe modules: {defining}"


def _top_level_modules_after(code: str) -> set[str]:
    """The top-level modules a fresh interpreter holds after running ``code``."""
    probe = code + "import sys\nprint('\\n'.join(sorted({n.split('.')[0] for n in sys.modules})))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def _top_level_imports(location: Path) -> set[str]:
    return {name.split(".")[0] for name in _module_imports(location)}


def _imports_of_modules(location: Path, prefixes: set[str]) -> set[str]:
    return {name for name in _module_imports(location) if any(name.startswith(f"{p}.") or name == p for p in prefixes)}


def _module_imports(location: Path) -> set[str]:
    """Every module named by an absolute import in ``location`` (a file, or a folder's modules)."""
    paths = [location] if location.is_file() else sorted(location.rglob("*.py"))
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return names


def _imports_of(package: Path, layers: set[str]) -> set[str]:
    """The imports of ``package``'s modules (read, not imported) that name one of ``layers``."""
    found: set[str] = set()
    for path in sorted(package.rglob("*.py")):
        for name in _module_imports(path):
            parts = name.split(".")
            if parts[0] == "sdcp" and len(parts) > 1 and parts[1] in layers:
                found.add(f"{path.relative_to(ROOT)}: {name}")
    return found


def test_docs_design_names_every_package() -> None:
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    packages = sorted(m.name for m in pkgutil.iter_modules(sdcp.__path__) if m.ispkg)
    missing = [name for name in packages if f"sdcp.{name}" not in design]
    assert not missing, f"docs/design.md does not place {missing}"


# The repository stands on its own: the draft is cited by name and section ("draft-li-sdcp, 6.5.2",
# "SDCP 6.5.2"), the architecture by docs/design.md; no path outside the repository (the team's notes
# and its copy of the draft) appears in a tracked file. Written in pieces so that this file passes.
OUTSIDE = re.compile("|".join(re.escape(piece) for piece in ("shared" + "/", "DESIGN" + ".md", "sdcp-draft" + ".txt")))
CHECKED = ("src", "tests", "docs", "README.md", "Makefile", "deploy", "scripts")


def test_no_tracked_file_cites_paths_outside_the_repository() -> None:
    # Every file under the checked paths, so that a checkout without git (a source archive) is
    # checked too; compiled and binary files are passed over below.
    names = [
        str(path.relative_to(ROOT))
        for top in CHECKED
        for path in ([ROOT / top] if (ROOT / top).is_file() else sorted((ROOT / top).rglob("*")))
        if "__pycache__" not in path.parts
    ]
    offending = []
    for name in names:
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:  # binary (the dashboard's picture)
            continue
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offending.append(f"{name}:{number}: {line.strip()}")
    assert not offending, "cite draft-li-sdcp by section and docs/design.md instead:\n" + "\n".join(offending)


def test_no_file_under_tests_imports_a_test_module_or_a_conftest() -> None:
    """Harnesses shared between test modules live in helper modules (tests/services/router_harness.py,
    tests/e2e/homes.py, ...) or as fixtures in a conftest.py, never in a test module or a conftest
    that another file imports (#40): a test module is no interface, and pytest alone loads conftests."""
    offending = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # `from tests.x.test_y import z`, `from .conftest import z`, and `from tests.x import
                # test_y` or `from . import conftest`, where the module is the imported name.
                package = "." * node.level + (node.module or "")
                modules = [package] if node.module else []
                modules += [f"{package.rstrip('.')}.{alias.name}" for alias in node.names]
            else:
                continue
            for module in modules:
                last = module.rsplit(".", 1)[-1]
                if last.startswith("test_") or last == "conftest":
                    offending.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {module}")
    assert not offending, "move what is shared into a helper module or a conftest fixture:\n" + "\n".join(offending)
