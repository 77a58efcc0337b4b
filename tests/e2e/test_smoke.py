"""The shortest journey: upload, create, wait, download, on both databases, with the SDK in strict mode."""

from __future__ import annotations

import json

from tests.support.server import ServerProcess, wait_for


def test_batch_journey(tiny_server: ServerProcess) -> None:
    client = tiny_server.client()
    lines = [
        {
            "custom_id": f"row-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 3},
        }
        for i in range(5)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data)
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "validating"
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, timeout=120)
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 5, 0)
    out = client.files.content(done.output_file_id).text.splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == [f"row-{i}" for i in range(5)]
    assert done.error_file_id is None
