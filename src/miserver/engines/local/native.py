"""The engine's native kernels (C sources beside this module): built on first use with the machine's C compiler and
loaded with ctypes.

A kernel runs on torch's own OpenMP threads: it is linked against ``libgomp.so.1``, the runtime torch has already
loaded, and is told how many threads to use. A shared object is built once per source, compiler and processor
(``-march=native``) under the cache folder given to :func:`build` and reused by later starts; a build takes about a
second. Without a compiler, or when the build or the load fails, :func:`build` logs why and returns None, and the
caller computes the same thing with torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-Wno-psabi")


def default_folder() -> Path:
    """``$XDG_CACHE_HOME/miserver/kernels`` (``~/.cache/miserver/kernels``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "miserver" / "kernels"


def _processor() -> str:
    """What ``-march=native`` compiles for: the CPU's model and flags (Linux), else the platform's machine name."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep))) or platform.machine()


def build(source: Path, folder: Path | None, what: str, fallback: str) -> ctypes.CDLL | None:
    """The shared object of the C file ``source``, built under ``folder`` (default :func:`default_folder`) as
    ``<source stem>-<key>.so`` unless a build for this source, compiler and processor is there; None when it cannot
    be built or loaded, logged as ``what`` (the kernel's name) with ``fallback`` (what runs instead). The compiler
    is ``$CC`` or ``cc``."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.warning("no C compiler (%s): %s", compiler, fallback)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256(
            "\0".join([source.read_text(), " ".join(FLAGS), version, _processor()]).encode()
        ).hexdigest()[:16]
        folder = folder or default_folder()
        target = folder / f"{source.stem}-{key}.so"
        if not target.exists():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                built = Path(scratch) / target.name
                subprocess.run(
                    [compiler, *FLAGS, "-o", str(built), str(source)], capture_output=True, text=True, check=True
                )
                os.replace(built, target)  # atomic: a concurrent start loads one whole file or builds its own
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        log.warning("the %s was not built (%s): %s", what, detail, fallback)
        return None
