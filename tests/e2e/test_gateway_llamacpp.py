"""llama.cpp's own server (``llama-server``, parallel slots) behind a ``--no-model`` gateway, on the embedded SmolLM2
GGUF file: the same journey as ``test_gateway_transformers.py`` (chat, completions and streams relayed; a 20-row batch;
the engine's error envelope mapped to OpenAI's; the engine killed mid-batch with a miServer taking over), and a batch
created with ``pack: true``, which is accepted and changes nothing for rows sent upstream.

The binary is ``MISERVER_TEST_LLAMA_SERVER`` or ``llama-server`` on ``PATH`` (``.ci/run`` unpacks
``../shared/tools/llama-server.xz`` when it is there). Without one, or with one built for another processor (it dies
with SIGILL at start), the module is skipped and the summary says why. The module shares its processes; the last
test kills the engine.
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

from miserver.process import ServerProcess, free_port, wait_for
from tests.support.batches import api_error, chat_body, error_of, jsonl, line, read_lines, submit, wait_terminal
from tests.support.engines import ILLEGAL_INSTRUCTION, EngineExited, EngineProcess, find_llama_server, llama_server
from tests.support.gateway_journey import batch_of_20, killed_mid_batch
from tests.support.server import tiny_server_process

BINARY, WHY_NOT = find_llama_server()
if BINARY is None:
    pytest.skip(WHY_NOT, allow_module_level=True)

MODEL = "smollm2-llamacpp"
ENGINE, TAKEOVER = "llamacpp", "mi"
QUESTION = "What is the capital of France? Answer in one word."
CHAT = chat_body(QUESTION, model=MODEL, max_tokens=8, temperature=0)


@dataclass
class Stack:
    engine: EngineProcess
    gateway: ServerProcess
    takeover_port: int
    root: Path

    def received(self) -> int:
        """Requests the engine has started so far (it logs each task it gives a slot)."""
        return self.engine.log_path.read_text(errors="replace").count("processing task")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    assert BINARY is not None
    root = tmp_path_factory.mktemp("llama-server")
    takeover_port = free_port()
    engine = llama_server(BINARY, root, alias=MODEL)
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
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.start(timeout=300), [engine, gateway]))
        yield Stack(engine, gateway, takeover_port, root)
    except EngineExited as exc:
        if exc.returncode != ILLEGAL_INSTRUCTION:
            raise
        pytest.skip(
            f"{BINARY} dies with SIGILL (Illegal instruction): it was built for another processor; build it again "
            "(../shared/NOTES.md has the cmake lines)"
        )
    finally:
        gateway.stop()
        engine.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    sdk = stack.gateway.client()
    wait_for(lambda: [m.id for m in sdk.models.list().data] == [MODEL], timeout=60)
    return sdk  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def direct(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.engine.base_url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def expected(direct: openai.OpenAI) -> ChatCompletion:
    return direct.chat.completions.create(**CHAT)


def test_the_engine_is_discovered_and_its_chat_answer_relayed(client: openai.OpenAI, expected: ChatCompletion) -> None:
    assert [(m.id, m.owned_by) for m in client.models.list().data] == [(MODEL, f"upstream:{ENGINE}")]
    via = client.chat.completions.with_raw_response.create(**CHAT)
    assert via.headers["x-millm-backend"] == f"upstream:{ENGINE}"
    answer = via.parse()
    assert answer.model == MODEL
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.choices[0].message.content == expected.choices[0].message.content
    assert answer.usage is not None and expected.usage is not None
    # the same counts (the details differ: the second asking of a prompt finds it in llama.cpp's prompt cache)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        expected.usage.prompt_tokens,
        expected.usage.completion_tokens,
    )


def test_a_text_completion_is_relayed(client: openai.OpenAI, direct: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    via = client.completions.with_raw_response.create(**body)
    assert via.headers["x-millm-backend"] == f"upstream:{ENGINE}"
    got, want = via.parse(), direct.completions.create(**body)
    assert got.choices[0].text == want.choices[0].text and "Paris" in got.choices[0].text
    assert got.usage is not None and want.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens, 5)


def test_a_stream_is_relayed_event_by_event(client: openai.OpenAI, expected: ChatCompletion) -> None:
    chunks = list(client.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 3 and {c.model for c in chunks} == {MODEL}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    assert chunks[-1].usage is not None and expected.usage is not None
    assert chunks[-1].usage.completion_tokens == expected.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == expected.usage.prompt_tokens
    short = list(client.chat.completions.create(**{**CHAT, "max_tokens": 1}, stream=True))
    assert short and all(c.usage is None for c in short)


def test_the_engines_error_answer_comes_back_in_openais_envelope(
    stack: Stack, client: openai.OpenAI, direct: openai.OpenAI
) -> None:
    # a prompt longer than a slot's context (4096 tokens over 4 slots): llama.cpp refuses it in OpenAI's envelope
    # with a numeric code, which becomes null
    bad = chat_body("a " * 1500, model=MODEL, max_tokens=2)
    own = api_error(direct.chat.completions.create, **bad)
    assert isinstance(own.body, dict) and isinstance(own.body.get("code"), int), own.body
    relayed = api_error(client.chat.completions.create, **bad)
    assert relayed.status_code == own.status_code == 400
    assert error_of(relayed) == {"message": own.body["message"], "type": own.body["type"], "param": None, "code": None}
    # the same parameter in a batch line: the row's error line carries that envelope, the other row runs
    rows = [line("bad", bad), line("good", chat_body(QUESTION, model=MODEL, max_tokens=2))]
    done = wait_terminal(client, submit(client, jsonl(rows)).id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    [failed] = read_lines(client, done.error_file_id)
    assert failed["custom_id"] == "bad" and failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"] == error_of(relayed)
    # a model nobody serves: refused by the gateway before sending (llama-server answers any name)
    before = stack.received()
    missing = api_error(client.chat.completions.create, **chat_body(QUESTION, model="nope", max_tokens=2))
    assert missing.status_code == 404 and error_of(missing)["code"] == "model_not_found"
    assert stack.received() == before


def test_pack_is_accepted_and_changes_nothing_for_upstream_rows(stack: Stack, client: openai.OpenAI) -> None:
    rows = [
        line(f"p{i}", chat_body(f"Name a colour, {i}.", model=MODEL, max_tokens=3, temperature=0)) for i in range(4)
    ]
    before = stack.received()
    batch = submit(client, jsonl(rows), extra_body={"pack": True})
    assert (batch.model_extra or {}).get("millm", {}).get("pack") is True  # accepted, not refused
    done = wait_terminal(client, batch.id)
    assert done.status == "completed", done.errors
    out = read_lines(client, done.output_file_id)
    assert [x["custom_id"] for x in out] == [f"p{i}" for i in range(4)]
    assert all(x["response"]["millm"]["packed"] is False for x in out)
    assert stack.received() - before == 4  # one request per row: the engine batches them itself
    one = httpx.post(f"{stack.gateway.base_url}/v1/chat/completions", json=rows[0]["body"], timeout=60).json()
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == one["choices"][0]["message"]["content"]


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
        max_tokens=48,  # llama.cpp is fast: rows long enough to be caught in flight
    )
