"""The ``miserver`` command line: a thin click layer over the library (DESIGN §3.6).

``base`` holds the ``main`` group and the helpers the commands share; each other module adds one family of
commands to it when imported: ``serve`` (serve, worker), ``db``, ``models``, ``batch`` and ``accounts`` (keys,
usage).
"""

from __future__ import annotations

from . import accounts, batch, db, models, serve  # noqa: F401  (importing a module registers its commands)
from .base import main

__all__ = ["main"]
