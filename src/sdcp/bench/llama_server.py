"""llama-server, llama.cpp's own OpenAI server: the anchor of the serving benchmarks (what a CPU user
runs instead of sdcp to serve a GGUF).

`llama_server_binary` builds it once from the llama.cpp source that the installed llama-cpp-python
ships (its sdist's ``vendor/llama.cpp``, the same kernels as sdcp's llama.cpp target) into
``$SDCP_HOME/llama-server/<version>/``, or takes one given by path. The build is static and portable
(x86-64 with AVX2, as the Makefile builds llama-cpp-python; ``CMAKE_ARGS`` replaces those flags) and
takes about 4 minutes on 2 cores. `LlamaServer` runs it on loopback with the settings a user would
give: the GGUF, the threads, the slots.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from sdcp.bench.workloads import BenchInputError
from sdcp.home import sdcp_home
from sdcp.localhost import free_port
from sdcp.models.weights.fetch import smollm2_gguf
from sdcp.threads import usable_cores

__all__ = ["LlamaServer", "llama_server_binary", "start_bench_llama_server"]

# The Makefile's flags for llama-cpp-python: llama.cpp's native build turns on kernels (AMX) that
# some sandboxes do not grant.
_PORTABLE_FLAGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
_BUILD_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
# A model of a few hundred MB loads in seconds; the bound is for a loaded machine.
_START_TIMEOUT_S = 300.0


def llama_server_binary(given: Path | None, log: Callable[[str], None]) -> Path:
    """The llama-server to run: ``given``, or the one built from the installed llama-cpp-python's
    llama.cpp source (built here first where it is not yet)."""
    if given is not None:
        if not given.is_file() or not os.access(given, os.X_OK):
            raise BenchInputError(f"--llama-server {given} is not an executable file")
        return given
    import llama_cpp

    version = llama_cpp.__version__
    home = sdcp_home() / "llama-server" / version
    binary = home / "llama-server"
    if binary.is_file():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BenchInputError(f"building llama-server needs {tool}; or give one with --llama-server PATH")
    log(f"building llama-server from llama-cpp-python {version}'s llama.cpp source into {home} (minutes)")
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home) as scratch:
        work = Path(scratch)
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={version}", "-d", str(work)])  # fmt: skip
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        (source,) = work.glob("llama_cpp_python-*/vendor/llama.cpp")
        build = work / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        flags = shlex.split(os.environ.get("CMAKE_ARGS") or _PORTABLE_FLAGS)
        _run(["cmake", "-S", str(source), "-B", str(build), *generator, *_BUILD_FLAGS, *flags])
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)])
        shutil.copy2(build / "bin" / "llama-server", binary)
    return binary


def _run(command: list[str]) -> None:
    completed = subprocess.run(command, capture_output=True, text=True, check=False)  # noqa: S603 - our own tools
    if completed.returncode != 0:
        tail = (completed.stderr or completed.stdout).strip().splitlines()[-20:]
        raise BenchInputError(f"{shlex.join(command[:4])} ... failed:\n" + "\n".join(tail))


class LlamaServer:
    """llama-server on a loopback port, serving ``gguf`` with ``threads`` threads and ``slots``
    slots (`--parallel`) of ``context`` positions each; its OpenAI API at ``url``."""

    def __init__(self, binary: Path, gguf: Path, *, threads: int, slots: int, context: int, log_file: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._command = [
            str(binary),
            "--model", str(gguf),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--threads", str(threads),
            "--threads-batch", str(threads),
            "--parallel", str(slots),
            "--ctx-size", str(context * slots),
        ]  # fmt: skip
        self._log_file = log_file
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self._log_file.parent.mkdir(parents=True, exist_ok=True)
        with self._log_file.open("wb") as log:
            self._process = subprocess.Popen(self._command, stdout=log, stderr=subprocess.STDOUT)  # noqa: S603
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._healthy():
            if self._process.poll() is not None:
                raise BenchInputError(f"llama-server exited with {self._process.returncode}; see {self._log_file}")
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise BenchInputError(
                    f"llama-server did not serve within {_START_TIMEOUT_S:.0f} s; see {self._log_file}"
                )
            time.sleep(0.2)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:  # noqa: S310
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False


def start_bench_llama_server(binary: Path, out: Path, *, slots: int, context: int) -> LlamaServer:
    """llama-server on the bundled GGUF with every usable core, serving (the caller exits it), its
    log in ``out``."""
    server = LlamaServer(
        binary, smollm2_gguf(), threads=usable_cores(), slots=slots, context=context, log_file=out / "llama-server.log"
    )
    return server.__enter__()
