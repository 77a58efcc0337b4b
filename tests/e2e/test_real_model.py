"""End to end on the real embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF) with the official SDK in strict mode.

One server on SQLite for the module. (a) 200 AG News rows (50 per label, the first of each label in file order) ask
for the topic through the Batch API; every row must complete, once, in input order, with a body that parses as an
SDK ``ChatCompletion``; the accuracy is printed (run with ``-s`` to see it). (b) A synchronous greedy chat answers
"Paris", and the model named without its quantization tag is a 404 that names the exact id.

The data set is read from ``../shared/data`` beside the repository (or ``MISERVER_SHARED_DATA``), never copied in.
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.support.server import ServerProcess, wait_for

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"
LABELS = ("World", "Sports", "Business", "Sci/Tech")
PER_LABEL = 50
SHARED_DATA = Path(os.environ.get("MISERVER_SHARED_DATA", Path(__file__).resolve().parents[2] / ".." / "shared" / "data"))
AG_NEWS = SHARED_DATA / "ag_news_samples.csv"

# The prompt of examples/topics.jsonl: a system prompt naming the four labels and four short examples as earlier
# turns (a 135M model follows a demonstrated answer format far better than an instruction alone).
SYSTEM = (
    "Classify the news by topic. Reply with one word:\n"
    "World: politics, governments, wars, elections, diplomacy, disasters.\n"
    "Sports: games, teams, athletes, matches.\n"
    "Business: companies, markets, prices, jobs, the economy.\n"
    "Sci/Tech: science, research, computers, the internet, space."
)
SHOTS = (
    ("Striker scores twice as club wins the league. The forward's late goals sealed the title on the last day.", "Sports"),
    ("Bank shares climb after strong profits. The lender earned more than expected as loan demand rose.", "Business"),
    ("New smartphone chip makes apps run faster. The processor uses less power and speeds up games.", "Sci/Tech"),
    ("Rebels attack capital as peace talks stall. The government declared an emergency after fighting spread.", "World"),
)
MAX_TOKENS = 4

_LABEL_KEYS = (("world", "World"), ("sport", "Sports"), ("business", "Business"), ("sci", "Sci/Tech"), ("tech", "Sci/Tech"))


def parse_label(answer: str) -> str | None:
    """The first of the four labels mentioned in ``answer`` (case-insensitive; 'sci' or 'tech' mean Sci/Tech)."""
    text = answer.lower()
    hits = [(i, label) for key, label in _LABEL_KEYS if (i := text.find(key)) >= 0]
    return min(hits)[1] if hits else None


def topic_messages(text: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}]
    for shot, label in SHOTS:
        messages += [{"role": "user", "content": shot}, {"role": "assistant", "content": label}]
    return [*messages, {"role": "user", "content": text}]


def ag_news_rows(per_label: int = PER_LABEL) -> list[dict[str, str]]:
    """The first ``per_label`` rows of each label, in file order (deterministic and balanced)."""
    if not AG_NEWS.exists():
        pytest.fail(f"shared data set missing: {AG_NEWS} (set MISERVER_SHARED_DATA to the shared/data folder)")
    taken = dict.fromkeys(LABELS, 0)
    rows = []
    with AG_NEWS.open(newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            if taken[row["label"]] < per_label:
                taken[row["label"]] += 1
                rows.append(row)
    assert all(n == per_label for n in taken.values()), taken
    return rows


def batch_lines(rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"ag-{i:03d}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": topic_messages(f"{row['title']}. {row['description']}"),
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            },
        }
        for i, row in enumerate(rows)
    ]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("real-model")
    server = ServerProcess(model=MODEL, database_url=f"sqlite:///{tmp / 'miserver.db'}", data_dir=tmp / "var")
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
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed", "expired", "cancelled") and b,
        timeout=1800,  # about 2 minutes on an idle 2-core machine; far longer when the cores are shared
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
        label = parse_label(answer)
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
