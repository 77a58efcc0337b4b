"""The checks every real engine behind the gateway goes through (``tests/e2e/test_gateway_transformers.py``,
``tests/e2e/test_gateway_llamacpp.py``): a 20-row batch, and the engine killed in the middle of a batch with a
second upstream (a miServer listing the same model id) taking over.

``received`` counts the generation requests the engine has received so far (from its log); ``backend`` is the
engine's ``X-miLLM-Backend`` value (``upstream:<name>``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai

from miserver.process import ServerProcess, wait_for
from tests.support.batches import chat_body, jsonl, line, read_lines, submit, wait_terminal
from tests.support.engines import EngineProcess


def batch_of_20(client: openai.OpenAI, model: str, backend: str, received: Callable[[], int]) -> None:
    """20 one-token rows: every row answered once by the engine, in input order, each line with its own usage and
    the batch's usage their sum. Row i's prompt is i tokens longer than row 0's, so each line's ``prompt_tokens``
    says which row it answers."""
    rows = [
        line(f"r{i:02d}", chat_body("Say hi." + " a" * i, model=model, max_tokens=1, temperature=0)) for i in range(20)
    ]
    before = received()
    done = wait_terminal(client, submit(client, jsonl(rows)).id, timeout=240)
    assert done.status == "completed", done.errors
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (20, 0)
    out = read_lines(client, done.output_file_id)
    assert [x["custom_id"] for x in out] == [f"r{i:02d}" for i in range(20)]
    usages = [x["response"]["body"]["usage"] for x in out]
    assert [u["prompt_tokens"] - usages[0]["prompt_tokens"] for u in usages] == list(range(20))
    assert all(u["completion_tokens"] == 1 for u in usages)
    assert {x["response"]["millm"]["headers"]["X-miLLM-Backend"] for x in out} == {backend}
    assert done.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (sum(u["prompt_tokens"] for u in usages), 20)
    assert received() - before == 20  # each row sent once: nothing failed, so nothing was retried


def killed_mid_batch(
    client: openai.OpenAI,
    model: str,
    engine: EngineProcess,
    backend: str,
    received: Callable[[], int],
    takeover: ServerProcess,
    takeover_backend: str,
    takeover_log: Path,
    *,
    max_tokens: int = 2,
) -> None:
    """12 rows of ``max_tokens`` each (long enough that rows are in flight when the engine is killed); the
    engine is killed (SIGKILL) once rows are recorded and more are in flight on it, then ``takeover`` (not yet
    started; on the port the gateway has configured for ``takeover_backend``, its execution log ``takeover_log``)
    starts and finishes the batch: every row recorded once, in input order, none lost; the takeover runs each row
    the engine had not answered exactly once (those in flight at the kill included)."""
    prompts = [f"Row {i}. Count from 1 to 100, separated by commas." for i in range(12)]
    rows = [
        line(f"k{i:02d}", chat_body(p, model=model, max_tokens=max_tokens, temperature=0))
        for i, p in enumerate(prompts)
    ]
    before = received()
    batch = submit(client, jsonl(rows))

    def recorded() -> int:
        counts = client.batches.retrieve(batch.id).request_counts
        return counts.completed if counts is not None else 0

    wait_for(lambda: (n := recorded()) >= 2 and received() - before > n, timeout=120)
    engine.kill9()
    with takeover:
        done = wait_terminal(client, batch.id, timeout=180)
        executed = takeover_log.read_text().split()  # a prompt digest per row run
        after = client.chat.completions.with_raw_response.create(**chat_body("still there?", model=model))
        assert after.headers["x-millm-backend"] == takeover_backend
    assert done.status == "completed", done.errors
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (12, 0)
    out = read_lines(client, done.output_file_id)
    assert [x["custom_id"] for x in out] == [f"k{i:02d}" for i in range(12)]  # every row, once, in input order
    backends = [x["response"]["millm"]["headers"]["X-miLLM-Backend"] for x in out]
    by_engine = backends.count(backend)
    assert by_engine >= 2 and backends.count(takeover_backend) == 12 - by_engine >= 1
    assert len(executed) == len(set(executed)) == 12 - by_engine
    usages = [x["response"]["body"]["usage"] for x in out]
    assert done.usage is not None and done.usage.output_tokens == sum(u["completion_tokens"] for u in usages)
