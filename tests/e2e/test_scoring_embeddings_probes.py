"""Scoring rows, embeddings, probes and packing end to end (DESIGN §3.4, §3.5, §4 "Packing"), SQLite and PostgreSQL.

A real server with the tiny model, driven with the official SDK in strict mode where the SDK's types allow it, and
with plain HTTP where they do not: the SDK validates an embeddings response before decoding its base64 vectors, and
types ``token_logprobs`` as floats while OpenAI (and miServer) send null for the first echoed prompt token.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from tests.support.batches import api_error, error_of, jsonl, line, read_lines, submit, wait_terminal
from tests.support.server import ServerProcess, tiny_server_process


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, module_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The tiny model on each database, with no padding cap: every scoring row or input of a batch window shares
    one pack whatever its length, so ``millm.packed`` is known in advance."""
    root = tmp_path_factory.mktemp("server")
    env = {"BATCH_PACK_MAX_PADDING": "1"}
    with tiny_server_process(tiny_model_dir, root, database_url=module_database_url, env=env) as started:
        yield started


TEXTS = ["hello there", "The sea was calm and the sky was grey over the harbour at dawn.", "ok", "Why is the sky blue?"]
TOL = 1e-4  # packed against single, float32
LONG = "word " * 600  # over the tiny model's 512-token context


def strip_ids(body: Any) -> Any:
    """A response body without its random id and creation time."""
    if isinstance(body, dict):
        return {k: strip_ids(v) for k, v in body.items() if k not in ("id", "created")}
    if isinstance(body, list):
        return [strip_ids(x) for x in body]
    return body


def close(a: Any, b: Any) -> bool:
    """Equal structures, floats within ``TOL``."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return isinstance(b, float) and abs(a - b) < TOL
    return bool(a == b)


def scoring_body(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "logprobs": True,
        "top_logprobs": 3,
        "seed": 11,
        **extra,
    }


def run_batch(client: openai.OpenAI, endpoint: str, bodies: list[dict[str, Any]], pack: bool) -> tuple[dict, dict]:
    """Submit ``bodies`` (custom ids ``r0``...) and wait; returns (output lines, error lines) by custom id."""
    data = jsonl(line(f"r{i}", b, url=endpoint) for i, b in enumerate(bodies))
    batch = wait_terminal(client, submit(client, data, endpoint=endpoint, extra_body={"pack": pack}).id)
    assert batch.status == "completed", batch
    assert (batch.model_extra or {})["millm"]["pack"] is pack
    out = {x["custom_id"]: x for x in read_lines(client, batch.output_file_id)}
    err = {x["custom_id"]: x for x in read_lines(client, batch.error_file_id)}
    assert len(out) + len(err) == len(bodies)
    return out, err


def test_embeddings_sync_float_base64_and_errors(server: ServerProcess) -> None:
    client = server.client()
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == "tiny" and [d.index for d in floats.data] == [0, 1, 2, 3]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    for d in floats.data:
        assert d.object == "embedding" and abs(float(np.linalg.norm(d.embedding)) - 1.0) < 1e-5
    raw = server.http().post("/v1/embeddings", json={"model": "tiny", "input": TEXTS, "encoding_format": "base64"})
    assert raw.status_code == 200 and raw.headers["x-millm-model"] == "tiny"
    for d, f in zip(raw.json()["data"], floats.data):
        assert np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist() == f.embedding
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="test", max_retries=0) as lenient:
        default = lenient.embeddings.create(model="tiny", input=TEXTS)
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data], (
        "the SDK's default (base64) decodes to the float result"
    )
    last = client.embeddings.create(
        model="tiny", input=TEXTS[1], encoding_format="float", extra_body={"pooling": "last"}
    )
    assert last.data[0].embedding != floats.data[1].embedding
    for kwargs, param, code in [
        ({"input": "x", "dimensions": 3}, "dimensions", "unsupported_parameter"),
        ({"input": LONG}, "input", "context_length_exceeded"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": "x", "model": "nope"}, "model", "model_not_found"),
    ]:
        exc = api_error(client.embeddings.create, **{"model": "tiny", "encoding_format": "float", **kwargs})
        assert exc.status_code == (404 if code == "model_not_found" else 400)
        assert (error_of(exc)["param"], error_of(exc)["code"]) == (param, code)


def test_echo_prompt_logprobs_sync(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": TEXTS[1], "max_tokens": 0, "echo": True, "logprobs": 2}
    r = server.http().post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == TEXTS[1] and "".join(lp["tokens"]) == TEXTS[1]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(len(t) == 2 for t in lp["top_logprobs"][1:])
    usage = r.json()["usage"]
    counts = (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
    assert counts == (len(lp["tokens"]), 0, len(lp["tokens"]))


def test_scoring_rows_pack_false_is_the_sync_result_and_pack_true_agrees(server: ServerProcess) -> None:
    client = server.client()
    http = server.http()
    bodies = [scoring_body(t) for t in TEXTS] + [scoring_body("write a line", max_tokens=4), scoring_body(LONG)]
    # the synchronous reference runs batch-invariant, as pack: false rows always do
    invariant = {"X-miLLM-Batch-Invariant": "true"}
    sync = [http.post("/v1/chat/completions", json=b, headers=invariant) for b in bodies]
    out, err = run_batch(client, "/v1/chat/completions", bodies, pack=False)
    for i, r in enumerate(sync[:-1]):
        response = out[f"r{i}"]["response"]
        assert response["millm"]["packed"] is False
        assert strip_ids(response["body"]) == strip_ids(r.json()), "pack: false equals the synchronous endpoint"
        headers = dict(response["millm"]["headers"])
        assert headers.pop("X-miLLM-Lease")  # the batch runs under its lease; the synchronous call had none
        assert {k: r.headers[k] for k in headers} == headers
    assert err["r5"]["response"]["status_code"] == sync[5].status_code == 400
    assert err["r5"]["response"]["body"] == sync[5].json()

    out, err = run_batch(client, "/v1/chat/completions", bodies, pack=True)
    for i, r in enumerate(sync[:-1]):
        response = out[f"r{i}"]["response"]
        assert response["millm"]["packed"] is (i < len(TEXTS)), "scoring rows pack; a generation row runs alone"
        assert close(strip_ids(response["body"]), strip_ids(r.json()))
    assert set(err) == {"r5"} and err["r5"]["response"]["body"] == sync[5].json(), "the over-long row fails alone"


def test_completion_scoring_rows_in_packs(server: ServerProcess) -> None:
    client = server.client()
    http = server.http()
    bodies = [{"model": "tiny", "prompt": [t, "and " + t], "max_tokens": 0, "echo": True, "logprobs": 1} for t in TEXTS]
    bodies.append({"model": "tiny", "prompt": TEXTS[0], "max_tokens": 1, "logprobs": 2, "seed": 4})
    out, err = run_batch(client, "/v1/completions", bodies, pack=True)
    assert not err
    for i, body in enumerate(bodies):
        response = out[f"r{i}"]["response"]
        assert response["millm"]["packed"] is True
        assert close(strip_ids(response["body"]), strip_ids(http.post("/v1/completions", json=body).json()))
    first = out["r0"]["response"]["body"]["choices"][1]["logprobs"]
    assert first["token_logprobs"][0] is None and first["tokens"][0] == "and"


def test_generation_rows_decode_together_under_pack_true(server: ServerProcess) -> None:
    """Batched generation (issue 17): generation rows of a pack: true window share decode steps and say so; at
    temperature 0 each gets the synchronous answer (text, finish reason, usage; logprobs within rounding)."""
    client = server.client()
    http = server.http()
    chat = [
        {"model": "tiny", "messages": [{"role": "user", "content": t}], "max_tokens": 3 + 2 * i, "temperature": 0}
        for i, t in enumerate(TEXTS)
    ]
    chat[1] |= {"logprobs": True, "top_logprobs": 2}
    chat.append({**chat[0], "n": 2, "temperature": 0.8, "seed": 5})
    out, err = run_batch(client, "/v1/chat/completions", chat, pack=True)
    assert not err
    for i, body in enumerate(chat):
        response = out[f"r{i}"]["response"]
        assert response["millm"]["packed"] is True
        assert close(strip_ids(response["body"]), strip_ids(http.post("/v1/chat/completions", json=body).json()))
    texts = [
        {"model": "tiny", "prompt": [t, "so " + t], "max_tokens": 4, "temperature": 0, "echo": True} for t in TEXTS[:2]
    ]
    out, err = run_batch(client, "/v1/completions", texts, pack=True)
    assert not err
    for i, body in enumerate(texts):
        response = out[f"r{i}"]["response"]
        assert response["millm"]["packed"] is True
        assert strip_ids(response["body"]) == strip_ids(http.post("/v1/completions", json=body).json())


def test_embedding_rows_pack_false_equal_sync_and_pack_true_agrees(server: ServerProcess) -> None:
    client = server.client()
    http = server.http()
    bodies: list[dict[str, Any]] = [
        {"model": "tiny", "input": TEXTS, "encoding_format": "float"},
        {"model": "tiny", "input": TEXTS[1], "encoding_format": "float", "pooling": "last"},
        {"model": "tiny", "input": ["fine", LONG]},
        {"model": "tiny", "input": [[1, 2, 3], [4, 5]], "encoding_format": "base64"},
    ]
    sync = [http.post("/v1/embeddings", json=b) for b in bodies]
    out, err = run_batch(client, "/v1/embeddings", bodies, pack=False)
    for i in (0, 1, 3):
        response = out[f"r{i}"]["response"]
        assert response["body"] == sync[i].json() and response["millm"]["packed"] is False
    assert err["r2"]["response"]["body"] == sync[2].json() and sync[2].status_code == 400
    out, err = run_batch(client, "/v1/embeddings", bodies, pack=True)
    assert set(err) == {"r2"} and err["r2"]["response"]["body"] == sync[2].json()
    for i in (0, 1):
        got, expected = out[f"r{i}"]["response"], sync[i].json()
        assert got["millm"]["packed"] is True and got["body"]["usage"] == expected["usage"]
        for g, e in zip(got["body"]["data"], expected["data"]):
            assert float(np.dot(g["embedding"], e["embedding"])) > 1 - 1e-6
    packed_b64 = out["r3"]["response"]["body"]["data"][0]["embedding"]
    single_b64 = sync[3].json()["data"][0]["embedding"]
    cosine = float(np.dot(*(np.frombuffer(base64.b64decode(x), dtype="<f4") for x in (packed_b64, single_b64))))
    assert cosine > 1 - 1e-6


def test_probes_create_score_sync_and_in_a_batch(server: ServerProcess) -> None:
    http = server.http()
    client = server.client()
    hidden = http.post("/v1/embeddings", json={"model": "tiny", "input": "x", "encoding_format": "float"}).json()
    width = len(hidden["data"][0]["embedding"])
    weights = [((-1) ** i) * 0.1 for i in range(width)]
    made = http.post("/api/probes", json={"name": "alternating", "layer": 1, "weights": weights, "bias": -0.2})
    assert made.status_code == 200, made.text
    assert made.json()["model"] == "tiny" and made.json()["weights"] == weights
    again = http.post("/api/probes", json={"name": "alternating", "layer": 1, "weights": weights, "bias": -0.2})
    assert again.status_code == 409 and again.json()["error"]["code"] == "probe_exists"
    trained = http.post(
        "/api/probes",
        json={
            "name": "topic",
            "layer": -1,
            "texts": ["goal scored", "match won", "stock fell", "market rose"],
            "labels": ["sports", "sports", "business", "business"],
        },
    )
    assert trained.status_code == 200 and trained.json()["classes"] == ["business", "sports"]
    score = http.post("/api/probes/score", json={"probe": "topic", "input": ["goal scored", "stock fell"]})
    assert score.status_code == 200 and score.headers["x-millm-model"] == "tiny"
    assert [d["label"] for d in score.json()["data"]] == ["sports", "business"]
    listed = http.get("/api/probes").json()
    assert {p["name"] for p in listed["data"]} >= {"alternating", "topic"}

    bodies: list[dict[str, Any]] = [
        {"probe": "alternating", "input": TEXTS},
        {"probe": "topic", "input": "match won"},
        {"probe": "missing", "input": "x"},
    ]
    sync = [http.post("/api/probes/score", json=b) for b in bodies]
    named = line("named-model", {"probe": "topic", "input": "x", "model": "tiny"}, url="/api/probes/score")
    data = jsonl([*(line(f"r{i}", b, url="/api/probes/score") for i, b in enumerate(bodies)), named])
    batch = wait_terminal(client, submit(client, data, endpoint="/api/probes/score", extra_body={"pack": True}).id)
    assert batch.status == "completed" and batch.model == "tiny"
    out = {x["custom_id"]: x for x in read_lines(client, batch.output_file_id)}
    err = {x["custom_id"]: x for x in read_lines(client, batch.error_file_id)}
    for i in (0, 1):
        assert out[f"r{i}"]["response"]["millm"]["packed"] is False, "probe rows run one at a time"
        assert out[f"r{i}"]["response"]["body"] == sync[i].json()
    assert sync[2].status_code == 404 and err["r2"]["response"]["body"] == sync[2].json()
    assert err["named-model"]["response"]["body"]["error"]["param"] == "body.model"  # probe lines name no model
    assert http.delete("/api/probes/alternating").json()["deleted"] is True
    assert http.get("/api/probes/alternating").status_code == 404


def test_probes_survive_a_restart_and_refuse_another_model(
    tiny_model_dir: Path, database_url: str, tmp_path: Path
) -> None:
    with tiny_server_process(tiny_model_dir, tmp_path, database_url=database_url) as first:
        made = first.http().post(
            "/api/probes", json={"name": "kept", "layer": 0, "pooling": "last", "weights": [0.5] * 64, "bias": 0.0}
        )  # the tiny model is 64 wide
        assert made.status_code == 200, made.text
    with tiny_server_process(tiny_model_dir, tmp_path, database_url=database_url, served_model_name="tiny-b") as second:
        http = second.http()
        kept = http.get("/api/probes/kept")
        assert kept.status_code == 200 and kept.json() == made.json(), "probes live in the database"
        r = http.post("/api/probes/score", json={"probe": "kept", "input": "hello"})
        assert r.status_code == 409
        assert r.json()["error"]["code"] == "probe_model_mismatch" and "'tiny'" in r.json()["error"]["message"]
        assert json.loads(r.text)["error"]["param"] == "probe"
