"""Probes in the store and through their service, on SQLite and PostgreSQL, with the tiny model.

The service is driven directly (no HTTP): create given and trained probes, score, refuse another model's probe,
list, get, delete. The HTTP routes and batch rows are covered end to end in tests/e2e.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from miserver.engines.base import PoolRequest
from miserver.engines.local.engine import LocalEngine
from miserver.errors import APIError
from miserver.scheduling.admission import AdmissionGate
from miserver.services.inference import probes
from miserver.services.inference.context import Call, ServiceContext, ServiceResult
from miserver.store import Store
from miserver.store import probes as store_probes
from miserver.store.probes import ProbeRecord

POSITIVE = ["good", "great movie", "wonderful day", "I love it", "excellent food", "happy times"]
NEGATIVE = ["bad", "awful movie", "terrible day", "I hate it", "disgusting food", "sad times"]


def context(engine: LocalEngine, store: Store) -> ServiceContext:
    return ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(0), store=store)


async def refused(coro: Any) -> APIError:
    try:
        await coro
    except APIError as exc:
        return exc
    raise AssertionError("an APIError was expected")


def record(name: str, **changes: Any) -> ProbeRecord:
    values: dict[str, Any] = dict(
        id=f"probe_{name}",
        name=name,
        model_id="m",
        weights_revision="sha256:x",
        layer=1,
        pooling="mean",
        hidden_size=2,
        classes=["no", "yes"],
        weights=[0.5, -1.25],
        bias=0.1,
        training=None,
        description=None,
        created_at=1,
    )
    return ProbeRecord(**{**values, **changes})


async def test_store_round_trip_and_unique_names(store: Store) -> None:
    async with store.tx() as conn:
        training = {"texts": 4, "C": 1.0, "train_accuracy": 1.0}
        assert await store_probes.insert_probe(conn, record("a", training=training))
        three = record("b", classes=[0, 1, 2], weights=[[1.0, 2.0]] * 3, bias=[0.0] * 3)
        assert await store_probes.insert_probe(conn, three)
        assert not await store_probes.insert_probe(conn, record("a", id="probe_other"))
    async with store.tx() as conn:
        a = await store_probes.get_probe(conn, "a")
        assert a == record("a", training={"texts": 4, "C": 1.0, "train_accuracy": 1.0})
        assert [p.name for p in await store_probes.list_probes(conn)] == ["a", "b"]
        assert (await store_probes.delete_probe(conn, "a")) == a
        assert await store_probes.delete_probe(conn, "a") is None
        assert await store_probes.get_probe(conn, "a") is None


async def test_given_and_trained_probes_score_and_refuse_another_model(engine: LocalEngine, store: Store) -> None:
    ctx = context(engine, store)
    call = Call(strict=True)
    hidden = engine.info.hidden_size
    weights = [float(x) for x in np.linspace(-1, 1, hidden)]
    given = await probes.create_probe(ctx, {"name": "given", "layer": 1, "weights": weights, "bias": 0.25}, call)
    assert (given["model"], given["layer"], given["classes"], given["hidden_size"]) == ("tiny", 1, [0, 1], hidden)
    assert given["weights"] == weights and given["training"] is None

    texts = POSITIVE + NEGATIVE
    labels = ["pos"] * len(POSITIVE) + ["neg"] * len(NEGATIVE)
    body = {"name": "sentiment", "layer": -1, "pooling": "last", "texts": texts, "labels": labels, "C": 10.0}
    trained = await probes.create_probe(ctx, body, call)
    assert trained["layer"] == engine.info.num_layers and trained["classes"] == ["neg", "pos"]
    assert trained["training"]["texts"] == len(texts) and trained["training"]["C"] == 10.0

    result = await probes.create(ctx, {"probe": "given", "input": ["good", "bad day"]}, call)
    assert isinstance(result, ServiceResult) and result.status_code == 200
    for item, text in zip(result.body["data"], ["good", "bad day"]):
        vec = await engine.embed(PoolRequest(tuple(engine.tokenize(text)), pooling="mean", layer=1))
        p1 = 1 / (1 + np.exp(-(float(np.dot(np.asarray(weights), vec.astype(np.float64))) + 0.25)))
        assert item["score"] == pytest.approx(p1, abs=1e-9) and item["probabilities"][1] == item["score"]
        assert item["label"] == (1 if p1 >= 0.5 else 0)
    assert result.headers["X-miLLM-Model"] == "tiny" and result.body["usage"]["prompt_tokens"] == 3

    again = await probes.create(ctx, {"probe": "sentiment", "input": texts}, call)
    accuracy = np.mean([d["label"] == lab for d, lab in zip(again.body["data"], labels)])  # type: ignore[union-attr]
    assert accuracy == pytest.approx(trained["training"]["train_accuracy"])

    other = context(LocalEngine.from_loaded(engine.loaded, "tiny-renamed"), store)
    mismatch = await refused(probes.create(other, {"probe": "given", "input": "x"}, call))
    assert (mismatch.status_code, mismatch.code, mismatch.param) == (409, "probe_model_mismatch", "probe")
    assert "'tiny'" in mismatch.message and "'tiny-renamed'" in mismatch.message

    listed = await probes.list_probes(ctx)
    assert [p["name"] for p in listed["data"]] == ["given", "sentiment"] and "weights" not in listed["data"][0]
    assert (await probes.get_probe(ctx, "sentiment"))["weights"] == trained["weights"]
    assert (await probes.delete_probe(ctx, "given"))["deleted"] is True
    missing = await refused(probes.create(ctx, {"probe": "given", "input": "x"}, call))
    assert (missing.status_code, missing.code, missing.param) == (404, "probe_not_found", "probe")


CREATE_ERRORS: list[tuple[dict[str, Any], int, str | None]] = [
    ({"name": "dup", "layer": 0, "weights": [0.0], "bias": 0.0}, 409, "name"),
    ({"name": "x", "layer": 99, "weights": [0.0], "bias": 0.0}, 400, "layer"),
    ({"name": "x", "layer": 0}, 400, "weights"),
    ({"name": "x", "layer": 0, "weights": [0.0], "bias": 0.0}, 400, "weights"),  # not the hidden size
    ({"name": "x", "layer": 0, "texts": ["a", "b"], "labels": ["p", "p"]}, 400, "labels"),
    ({"name": "x", "layer": 0, "texts": ["a", ""], "labels": [0, 1]}, 400, "texts[1]"),
    ({"name": "x", "layer": 0, "texts": ["a", "b"], "labels": [0, 1], "classes": [0, 1]}, 400, "classes"),
    ({"name": "bad name!", "layer": 0, "weights": [0.0], "bias": 0.0}, 400, "name"),
    ({"name": "x", "layer": 0, "weights": [0.0], "bias": 0.0, "extra": 1}, 400, "extra"),
    ({"name": "x", "layer": 0, "weights": [0.0], "bias": 0.0, "model": "nope"}, 404, "model"),
]


async def test_create_and_score_refusals_name_the_field(engine: LocalEngine, store: Store) -> None:
    ctx = context(engine, store)
    call = Call(strict=True)
    hidden = engine.info.hidden_size
    await probes.create_probe(ctx, {"name": "dup", "layer": 0, "weights": [0.0] * hidden, "bias": 0.0}, call)
    for body, status, param in CREATE_ERRORS:
        exc = await refused(probes.create_probe(ctx, body, call))
        assert (exc.status_code, exc.param) == (status, param), body
    for body, param in [
        ({"probe": "dup", "input": []}, "input"),
        ({"probe": "dup", "input": "w " * 600}, "input"),
        ({"probe": "dup", "input": "x", "model": "tiny"}, "model"),
    ]:
        exc = await refused(probes.create(ctx, body, call))
        assert (exc.status_code, exc.param) == (400, param), body
