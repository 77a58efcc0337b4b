"""``python -m miserver.cli``: the ``miserver`` command (used to spawn servers and workers as subprocesses)."""

from __future__ import annotations

from . import main

if __name__ == "__main__":
    main()
