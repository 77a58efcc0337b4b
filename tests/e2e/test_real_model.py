"""End to end on the real embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF) with the official SDK in strict mode.

One server on SQLite for the module. (a) 200 AG News rows (50 per label, the first of each label in file order) ask
for the topic through the Batch API, packed (``pack: true``: rows decode together; ``make demo`` runs the default,
one row at a time, on the same model); every row must complete, once, in input order, with a body that parses as an
SDK ``ChatCompletion``; the accuracy is printed (run with ``-s`` to see it). (b) A synchronous greedy chat answers
"Paris", and the model named without its quantization tag is a 404 that names the exact id.

The rows come from ``tests/data/ag_news_sample.csv`` (the first 50 items of each label of the AG News subset of the
OpenAI cookbook, MIT licence), so the test needs nothing beside the repository.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion

from miserver.settings import EMBEDDED_MODEL_ID
from tests.support.agnews import LABELS, SAMPLE, balanced_items, few_shot_messages, predicted_label
from tests.support.server import ServerProcess, real_model_server, wait_for

pytestmark = pytest.mark.slow

MODEL = EMBEDDED_MODEL_ID
PER_LABEL = 25
MAX_TOKENS = 4


def ag_news_rows(per_label: int = PER_LABEL) -> list[dict[str, str]]:
    """The first ``per_label`` rows of each label, in file order, from the sample the repository ships."""
    rows = balanced_items(per_label, SAMPLE)
    assert len(rows) == per_label * len(LABELS)
    return rows


def batch_lines(rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"ag-{i:03d}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": few_shot_messages(f"{row['title']}. {row['description']}"),
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            },
        }
        for i, row in enumerate(rows)
    ]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("real-model")
    server = real_model_server(tmp)
    with server:
        yield server


def test_ag_news_topics_through_the_batch_api(real_server: ServerProcess) -> None:
    client = real_server.client(timeout=60.0)
    rows = ag_news_rows()
    lines = batch_lines(rows)
    n = len(lines)
    assert n == 4 * PER_LABEL
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("ag_news_topics.jsonl", data), purpose="batch")
    started = time.monotonic()
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", extra_body={"pack": True}
    )
    done = wait_for(
        lambda: (
            (b := client.batches.retrieve(batch.id)).status in ("completed", "failed", "expired", "cancelled") and b
        ),
        timeout=1800,  # about a minute on an idle 2-core machine; far longer when the cores are shared
        interval=0.5,
    )
    wall = time.monotonic() - started
    assert done.status == "completed", done.errors
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (n, n, 0)
    assert done.error_file_id is None and done.output_file_id is not None

    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines() if x.strip()]
    assert [o["custom_id"] for o in out] == [line["custom_id"] for line in lines]  # each once, in input order
    correct = 0
    predicted = dict.fromkeys((*LABELS, None), 0)
    for o, row in zip(out, rows, strict=True):
        assert o["error"] is None and o["response"]["status_code"] == 200
        completion = ChatCompletion.model_validate(o["response"]["body"])
        assert completion.model == MODEL
        answer = completion.choices[0].message.content
        assert answer and answer.strip()
        label = predicted_label(answer)
        predicted[label] += 1
        correct += label == row["label"]
    accuracy = correct / len(rows)
    print(
        f"\nAG News topics on {MODEL}: accuracy {accuracy:.1%} ({correct}/{len(rows)}, chance 25%); "
        f"predicted {predicted}; {len(rows) / wall:.2f} rows/s ({wall:.1f} s)"
    )


def test_sync_chat_answers_paris(real_server: ServerProcess) -> None:
    client = real_server.client(timeout=60.0)
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        max_tokens=16,
        temperature=0,
    )
    assert completion.model == MODEL
    answer = completion.choices[0].message.content or ""
    assert "Paris" in answer, answer


def test_model_without_its_tag_names_the_exact_id(real_server: ServerProcess) -> None:
    client = real_server.client()
    untagged = MODEL.split(":")[0]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model=untagged, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    error = info.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    assert MODEL in error["message"]
