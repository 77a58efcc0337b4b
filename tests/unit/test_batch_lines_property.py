"""Issue 18, item 3, in process: Hypothesis batch files (valid lines mixed with mutated ones: wrong types, missing
and extra keys, huge, negative and non-finite numbers, deep nesting, characters of every plane, unpaired surrogates,
byte-order marks, control characters, bad UTF-8, lines near the 1 MiB limit) through the batch validator's own line
check, :func:`miserver.batches.validate.check_line`.

For every file: no line raises (one bad line never fails the batch); every unmutated line is valid; every refused
line has a code and a ``param`` that names a field of the line (or none, for a line that is not a JSON object); and
the refusal equals what the synchronous route's service check answers for the same body in strict mode. The same
generators run against a real server in ``tests/e2e/test_schema_fuzz.py`` and, for longer, in ``tools/fuzz.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from miserver.batches.validate import check_line
from miserver.engines.base import EngineInfo
from miserver.errors import APIError
from miserver.scheduling.admission import AdmissionGate
from miserver.services.inference.context import ServiceContext
from miserver.services.inference.registry import SERVICES
from tests.support.fuzz_lines import ENDPOINT, MODEL, Line, batch_file, param_problem


@pytest.fixture(scope="module")
def ctx() -> ServiceContext:
    engine = SimpleNamespace(info=EngineInfo(MODEL, "serial", "float32", "sha256:0", 512))
    return ServiceContext(engine=engine, gate=AdmissionGate(1))  # type: ignore[arg-type]


def _sync_answer(ctx: ServiceContext, body: object) -> tuple[int, str | None, str | None] | None:
    """What the synchronous route's service check says of ``body`` in strict mode (None: it would run)."""
    try:
        SERVICES[ENDPOINT].check(ctx, body, strict=True)
    except APIError as exc:
        return exc.status_code, exc.code, exc.param
    return None


def _line_fields_fine(line: Line) -> bool:
    """Whether the line's own fields pass (so that a refusal can only come from its body)."""
    obj = line.obj
    return (
        obj is not None
        and set(obj) == {"custom_id", "method", "url", "body"}
        and isinstance(obj["custom_id"], str)
        and 0 < len(obj["custom_id"]) <= 64
        and obj["method"] == "POST"
        and obj["url"] == ENDPOINT
        and isinstance(obj["body"], dict)
        and obj["body"].get("stream") is not True
    )


SLOW_DATA = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=SLOW_DATA,
)
@given(lines=batch_file(max_lines=10))
def test_every_line_is_checked_alone_and_named(ctx: ServiceContext, lines: list[Line]) -> None:
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        checked = check_line(ctx, ENDPOINT, line.raw, seen)  # never raises: one bad line never fails the batch
        where = f"line {number} ({line.mutation}): {line.raw[:200]!r}"
        if line.valid is True:
            assert checked.error is None, f"{where} refused: {checked.error and checked.error.envelope()}"
            assert checked.custom_id == line.obj["custom_id"] if line.obj else True
            continue
        if line.valid is False:
            assert checked.error is not None, f"{where} was accepted"
        if checked.error is None:
            continue
        error = checked.error
        assert error.status_code in (400, 404), where
        problem = param_problem(line, error.code, error.param)
        assert problem is None, f"{where}: {problem}"
        if _line_fields_fine(line) and line.obj is not None:
            sync = _sync_answer(ctx, line.obj["body"])  # the same answer, the param named inside the line's body
            assert sync is not None and sync[2] is not None, where
            assert (sync[0], sync[1], f"body.{sync[2]}") == (error.status_code, error.code, error.param), where
