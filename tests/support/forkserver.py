"""Start ``miserver`` server processes for the tests from a fork server that has already imported torch,
transformers and the server (the standard library's ``multiprocessing`` "forkserver" start method, with
``set_forkserver_preload``).

A spawned ``python -m miserver.cli serve`` spends about 8 of its 10 seconds (idle 2-core machine) importing torch
and transformers; the suite starts some seventy servers. A child forked from the preloaded fork server is a fresh
process all the same (its own pid, environment, log, signals, exit status, kill -9), but starts without those
imports. :func:`install` makes :class:`miserver.process.ServerProcess` use it (``tests/conftest.py`` does, once per
pytest process); everything else (the demo, the benchmarks, the CLI tests' ``miserver worker`` commands) still
spawns a new interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from miserver import process

#: imported once by the fork server; every child starts with them loaded
PRELOAD = ["torch", "transformers", "miserver.engines.local.engine", "miserver.app", "miserver.cli"]

_context: Any = None


def _run(args: list[str], env: dict[str, str], log_path: str, new_session: bool) -> None:
    """The child: its own session if asked, stdout and stderr appended to ``log_path``, exactly ``env`` as its
    environment, then the CLI (``SystemExit`` gives the exit status, as for a spawned ``python -m miserver.cli``)."""
    if new_session:
        os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = ["miserver", *args]
    from miserver.cli import main

    main(args=args, prog_name="miserver")


class ForkedProcess:
    """The part of :class:`subprocess.Popen` that :func:`miserver.process.stop_process` and the tests use, over a
    :class:`multiprocessing.Process` (``returncode`` is ``-N`` after signal N, as Popen's)."""

    def __init__(self, proc: multiprocessing.process.BaseProcess) -> None:
        self._proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def spawn(cmd: list[str], env: dict[str, str], log_path: Path, new_session: bool) -> ForkedProcess:
    """Start ``cmd`` (``[python, "-m", "miserver.cli", ...]``) as a child of the fork server."""
    global _context
    if cmd[1:3] != ["-m", "miserver.cli"]:
        raise ValueError(f"only miserver.cli commands are forked: {cmd}")
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    proc = _context.Process(target=_run, args=(cmd[3:], env, str(log_path), new_session), daemon=True)
    proc.start()
    return ForkedProcess(proc)


def install() -> None:
    """Make :class:`miserver.process.ServerProcess` start its servers through :func:`spawn`."""
    process.SPAWN = spawn
