"""A real third-party engine behind the gateway: ``transformers serve`` (transformers' own OpenAI-compatible server)
on the embedded SmolLM2 weights, in front of it a ``--no-model`` miServer, driven with the official SDK.

Chat, text completions and streams are relayed and equal the engine's direct answers; a 20-row batch runs every
row once, in input order, with its usage; the engine's own error answers come back in OpenAI's envelope; and the
engine killed (SIGKILL) in the middle of a batch loses no row when a second upstream (a miServer on the tiny model,
listing the same model id) comes up and takes over.

The module shares its processes; the last test kills the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

from miserver.engines.upstream.errors import normalize_error
from miserver.process import ServerProcess, free_port, wait_for
from tests.support.batches import api_error, chat_body, error_of
from tests.support.engines import EngineProcess, transformers_requests, transformers_serve
from tests.support.gateway_journey import batch_of_20, killed_mid_batch
from tests.support.server import tiny_server_process

MODEL = "smollm2"
#: The upstream names in ``X-miLLM-Backend``: the engine, and the miServer that takes over in the last test.
ENGINE, TAKEOVER = "hf", "mi"
QUESTION = "What is the capital of France? Answer in one word."


@dataclass
class Stack:
    engine: EngineProcess
    gateway: ServerProcess
    #: where the takeover miServer will listen (configured on the gateway from the start, down until started)
    takeover_port: int
    root: Path

    def received(self) -> int:
        """Generation requests the engine has received so far (it logs each as it arrives)."""
        return transformers_requests(self.engine.log_path.read_text(errors="replace"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("transformers-serve")
    takeover_port = free_port()
    engine = transformers_serve(MODEL, root / "engine")
    entries = f"{ENGINE}={engine.base_url};max_in_flight=4,{TAKEOVER}=http://127.0.0.1:{takeover_port}"
    env = {
        "MISERVER_NO_MODEL": "1",
        "MISERVER_UPSTREAMS": entries,
        "MISERVER_UPSTREAM_HEALTH_SECONDS": "0.5",
        "MISERVER_UPSTREAM_BACKOFF_SECONDS": "0.05",
        "BATCH_POLL_SECONDS": "0.2",
    }
    gateway = ServerProcess(data_dir=root / "gateway", database_url=f"sqlite:///{root / 'gateway.db'}", env=env)
    try:
        # side by side: the gateway probes the engine until it answers
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.start(timeout=300), [engine, gateway]))
        yield Stack(engine, gateway, takeover_port, root)
    finally:
        gateway.stop()
        engine.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    """The SDK on the gateway, once the gateway lists the engine's model."""
    sdk = stack.gateway.client()
    wait_for(lambda: [m.id for m in sdk.models.list().data] == [MODEL], timeout=60)
    return sdk  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def direct(stack: Stack) -> Iterator[openai.OpenAI]:
    """The SDK talking to the engine itself, for the answers the gateway must relay unchanged."""
    with openai.OpenAI(base_url=stack.engine.base_url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


CHAT = chat_body(QUESTION, model=MODEL, max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def expected(direct: openai.OpenAI) -> ChatCompletion:
    """The engine's own greedy answer to :data:`CHAT`."""
    return direct.chat.completions.create(**CHAT)


def _without_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_the_engine_is_discovered_and_its_chat_answer_relayed(client: openai.OpenAI, expected: ChatCompletion) -> None:
    assert [(m.id, m.owned_by) for m in client.models.list().data] == [(MODEL, f"upstream:{ENGINE}")]
    via = client.chat.completions.with_raw_response.create(**CHAT)
    assert via.headers["x-millm-backend"] == f"upstream:{ENGINE}"
    assert via.headers["x-millm-model"] == MODEL
    answer = via.parse()
    assert "Paris" in (answer.choices[0].message.content or "")  # the real model, not noise
    assert _without_ids(answer.model_dump()) == _without_ids(expected.model_dump())


def test_a_text_completion_is_relayed(client: openai.OpenAI, direct: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    via = client.completions.with_raw_response.create(**body)
    assert via.headers["x-millm-backend"] == f"upstream:{ENGINE}"
    got, want = via.parse(), direct.completions.create(**body)
    assert got.choices[0].text == want.choices[0].text and "Paris" in got.choices[0].text
    assert got.usage == want.usage and got.usage is not None and got.usage.completion_tokens == 5


def test_a_stream_is_relayed_event_by_event(client: openai.OpenAI, expected: ChatCompletion) -> None:
    chunks = list(client.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 3 and {c.model for c in chunks} == {MODEL}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    assert chunks[-1].usage == expected.usage
    # the engine always reports usage (the gateway asks for it, to bill the stream); unasked, the client sees none
    short = list(client.chat.completions.create(**{**CHAT, "max_tokens": 1}, stream=True))
    assert short and all(c.usage is None for c in short)
    assert [c.choices[0].finish_reason for c in short if c.choices][-1] == "length"


def test_the_engines_error_answers_come_back_in_openais_envelope(
    stack: Stack, client: openai.OpenAI, direct: openai.OpenAI
) -> None:
    # a parameter the engine refuses (the gateway's synchronous route ignores an unknown field and relays the body)
    bad = chat_body(QUESTION, model=MODEL, max_tokens=2, extra_body={"top_k": 5})
    own = api_error(direct.chat.completions.create, **bad)
    assert own.status_code == 422 and isinstance(own.body, dict) and "top_k" in own.body["detail"]  # FastAPI's
    relayed = api_error(client.chat.completions.create, **bad)
    assert relayed.status_code == 422
    assert error_of(relayed) == {
        "message": own.body["detail"],
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }

    # a model the engine does not serve: refused by the gateway before sending, in our envelope
    before = stack.received()
    missing = api_error(client.chat.completions.create, **chat_body(QUESTION, model="nope", max_tokens=2))
    assert missing.status_code == 404 and error_of(missing)["code"] == "model_not_found"
    assert stack.received() == before
    # and the engine's own answer to it, a 400 in FastAPI's shape, reads as OpenAI's envelope with its message
    raw = httpx.post(f"{stack.engine.base_url}/v1/chat/completions", json=chat_body(QUESTION, model="nope"))
    assert raw.status_code == 400 and "pinned" in raw.json()["detail"]
    assert normalize_error(raw.status_code, raw.content, ENGINE) == {
        "error": {"message": raw.json()["detail"], "type": "invalid_request_error", "param": None, "code": None}
    }


def test_a_batch_of_20_runs_every_row_once_in_order_with_its_usage(stack: Stack, client: openai.OpenAI) -> None:
    batch_of_20(client, MODEL, f"upstream:{ENGINE}", stack.received)


def test_the_engine_killed_mid_batch_loses_no_row_and_records_none_twice(
    stack: Stack, client: openai.OpenAI, tiny_model_dir: Path
) -> None:
    root = stack.root / "takeover"
    takeover = tiny_server_process(tiny_model_dir, root, served_model_name=MODEL, port=stack.takeover_port)
    killed_mid_batch(
        client,
        MODEL,
        stack.engine,
        f"upstream:{ENGINE}",
        stack.received,
        takeover,
        f"upstream:{TAKEOVER}",
        root / "executions.log",
    )
