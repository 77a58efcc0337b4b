"""In-process application helpers: an injectable clock, the weights-torn flag, and holding a batch at finalizing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from miserver import clock as server_clock
from miserver.batches import runner as runner_module


class Clock:
    """Real time plus ``offset`` seconds; installed as miServer's clock by :func:`installed_clock`."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@contextmanager
def installed_clock() -> Iterator[Clock]:
    clock = Clock()
    server_clock.set_clock(clock)
    try:
        yield clock
    finally:
        server_clock.set_clock(None)


async def set_weights_torn(database_url: str, torn: bool, model_id: str = "tiny") -> None:
    """Set the store's weights-torn flag behind the server's back (as another process would): batches wait while it
    is set. The write runs on a thread of its own: run on the event loop it would block the in-process server, and a
    transaction of the server's that was open then could never commit (SQLite: "database is locked")."""

    def write() -> None:
        sqlite = database_url.startswith("sqlite")
        engine = sa.create_engine(database_url, connect_args={"timeout": 30} if sqlite else {})
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM model_state WHERE model_id = :m"), {"m": model_id})
            conn.execute(
                sa.text("INSERT INTO model_state (model_id, weights_torn, updated_at) VALUES (:m, :t, 0)"),
                {"m": model_id, "t": torn},
            )
        engine.dispose()

    await asyncio.to_thread(write)


def hold_finishing(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Make the runner wait before writing a batch's files (the batch stays ``finalizing``) until the event is set."""
    release = asyncio.Event()
    real_finish = runner_module.output.finish

    async def held_finish(*args: Any, **kwargs: Any) -> bool:
        await release.wait()
        return await real_finish(*args, **kwargs)

    monkeypatch.setattr(runner_module.output, "finish", held_finish)
    return release
