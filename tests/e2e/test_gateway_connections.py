"""A kept-alive connection that the upstream closes just as the gateway reuses it is not an outage.

Servers end idle kept-alive connections after a timeout of their own (uvicorn's: 5 s, under vLLM, SGLang and
miServer). A request that reuses such a connection at that moment gets no answer ("Server disconnected without
sending a response"); the server never read it. The gateway sends it again at once, until a new connection carries
it, instead of marking the upstream down (which answered 503 to synchronous requests and held batch rows until the
next probe), and its pool never keeps an idle connection as long as those servers do (``KEEPALIVE_EXPIRY``).

The upstream is a real HTTP server process that closes, unanswered, every request after the first on a connection
(``--drop-reused``): every reuse meets the race.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.e2e.test_gateway_discovery import MODEL, gateway
from tests.support.batches import chat_body, jsonl, line, read_lines, submit, wait_terminal
from tests.support.fake_upstream import FakeUpstream


def test_a_connection_closed_at_reuse_is_sent_again_and_the_upstream_stays_live(tmp_path: Path) -> None:
    with FakeUpstream(model=MODEL, drop_reused=True, content_log=tmp_path / "sent.log") as upstream:
        server = gateway(tmp_path, upstream.base_url).start()  # probes every 0.3 s: on reused connections too
        try:
            client = server.client()  # max_retries=0: a 503 would not be retried away

            def ask(i: int) -> str | None:
                return client.chat.completions.create(**chat_body(f"q{i}", model=MODEL)).choices[0].message.content

            answers = [ask(i) for i in range(6)]
            with ThreadPoolExecutor(4) as pool:  # several kept-alive connections at once: a retry may meet another
                answers += list(pool.map(ask, range(6, 12)))
            ids = [f"b{i}" for i in range(8)]
            done = wait_terminal(client, submit(client, jsonl([line(c, chat_body(c, model=MODEL)) for c in ids])).id)
            (health,) = server.http().get("/api/health/detailed").json()["upstreams"]
            out = read_lines(client, done.output_file_id)
        finally:
            server.stop()
    assert answers == [f"echo: q{i}" for i in range(12)]
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.failed == 0
    assert [x["custom_id"] for x in out] == ids
    assert (health["live"], health["last_error"]) == (True, None)
    assert sorted((tmp_path / "sent.log").read_text().split()) == sorted([f"q{i}" for i in range(12)] + ids)
