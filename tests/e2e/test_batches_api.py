"""Batches API end to end (DESIGN §3.2-§4): create, list, retrieve, validation, results, cancel; SQLite and PostgreSQL.

The tests share one server per database kind (``module_server``); each waits for its batches to end. Expiry is not
tested here: the shortest window is one hour and the server's clock cannot be moved from a test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import QUANTIZED_ID
from tests.support.batches import (
    STATUS_ORDER,
    TERMINAL,
    api_error,
    chat_body,
    error_of,
    jsonl,
    line,
    read_lines,
    submit,
    wait_terminal,
)
from tests.support.server import ServerProcess, tiny_server_process, wait_for

PROVENANCE = ("X-miLLM-Model", "X-miLLM-Backend", "X-miLLM-Seed", "X-miLLM-Weights", "X-miLLM-Dtype")
#: A prompt that fits the tiny model's 512-token context but not with 300 more tokens of completion.
LONG_PROMPT = "tell me more about this " * 60


def batch_ids(client: openai.OpenAI) -> list[str]:
    return [b.id for b in client.batches.list(limit=100)]  # auto-paginates


def invalid_only_file(client: openai.OpenAI) -> str:
    """An input file whose only line is invalid: a batch over it fails at validation without running anything."""
    return client.files.create(file=("bad.jsonl", b"{oops\n"), purpose="batch").id


def assert_result_files(client: openai.OpenAI, batch: Any, custom_ids: list[str]) -> tuple[list[dict], list[dict]]:
    """Output and error files in input order, every custom_id exactly once across both, counts consistent."""
    out, err = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    position = {cid: i for i, cid in enumerate(custom_ids)}
    for lines in (out, err):
        order = [position[x["custom_id"]] for x in lines]
        assert order == sorted(order), "result lines must follow the input order"
    seen = [x["custom_id"] for x in out + err]
    assert sorted(seen) == sorted(custom_ids), "each custom_id exactly once across output and error files"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(custom_ids), len(out), len(err))
    assert counts.completed + counts.failed == counts.total
    return out, err


# -- create, retrieve, list, timestamps -----------------------------------------------------------------------


def test_lifecycle_timestamps_and_fields(module_server: ServerProcess) -> None:
    client = module_server.client()
    ids = [f"row-{i}" for i in range(3)]
    data = jsonl([line(cid, chat_body(f"Count to {i}")) for i, cid in enumerate(ids)])
    batch = submit(
        client,
        data,
        metadata={"description": "timestamps", "team": "e2e"},
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert batch.id.startswith("batch_")
    assert batch.object == "batch"
    assert batch.status == "validating"
    assert batch.endpoint == "/v1/chat/completions"
    assert batch.completion_window == "24h"
    assert batch.expires_at == batch.created_at + 24 * 3600
    assert batch.metadata == {"description": "timestamps", "team": "e2e"}
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (0, 0, 0)
    assert batch.output_file_id is None and batch.error_file_id is None
    for name in (
        "in_progress_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    ):
        assert getattr(batch, name) is None, name
    assert (batch.model_extra or {}).get("millm", {}).get("pack") is False

    statuses = [batch.status]

    def finished() -> Any:
        b = client.batches.retrieve(batch.id)
        if b.status != statuses[-1]:
            statuses.append(b.status)
        return b.status in TERMINAL and b

    done = wait_for(finished, timeout=120, interval=0.05)
    ranks = [STATUS_ORDER[s] for s in statuses]
    assert ranks == sorted(ranks), f"statuses went backwards: {statuses}"
    assert done.status == "completed", done
    assert done.created_at == batch.created_at and done.expires_at == batch.expires_at
    assert done.in_progress_at is not None and done.finalizing_at is not None and done.completed_at is not None
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.failed_at is None and done.expired_at is None and done.cancelled_at is None
    assert done.model == "tiny"
    assert done.errors is None
    assert_result_files(client, done, ids)
    assert done.error_file_id is None
    out_file = client.files.retrieve(done.output_file_id)  # type: ignore[arg-type]
    assert out_file.purpose == "batch_output"
    assert out_file.filename.endswith(".jsonl")
    assert out_file.expires_at == out_file.created_at + 7200
    assert out_file.bytes == len(client.files.content(out_file.id).content)
    assert out_file.id in [f.id for f in client.files.list(purpose="batch_output")]
    assert out_file.id not in [f.id for f in client.files.list(purpose="batch")]

    # retrieve and list agree with each other
    assert client.batches.retrieve(batch.id) == done
    listed = {b.id: b for b in client.batches.list(limit=100)}
    assert listed[batch.id] == done


def test_list_newest_first_and_paginates(module_server: ServerProcess) -> None:
    client = module_server.client()
    file_id = invalid_only_file(client)
    mine = [
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(5)
    ]
    for bid in mine:
        assert wait_terminal(client, bid).status == "failed"
    everything = batch_ids(client)
    assert everything[:5] == mine[::-1], "newest first"
    assert len(everything) == len(set(everything))

    pages: list[list[str]] = []
    after: str | None = None
    while True:
        page = client.batches.list(limit=2, **({"after": after} if after else {}))
        got = [b.id for b in page.data]
        assert 1 <= len(got) <= 2
        pages.append(got)
        after = got[-1]
        if not page.has_more:
            break
    assert [i for p in pages for i in p] == everything
    assert all(len(p) == 2 for p in pages[:-1])

    raw = module_server.http().get("/v1/batches", params={"limit": 2}).json()
    assert raw["object"] == "list"
    assert (raw["first_id"], raw["last_id"], raw["has_more"]) == (everything[0], everything[1], len(everything) > 2)


@pytest.mark.parametrize("limit", [0, 101, -1])
def test_list_limit_out_of_range(module_server: ServerProcess, limit: int) -> None:
    exc = api_error(module_server.client().batches.list, limit=limit)
    assert exc.status_code == 400
    assert error_of(exc)["param"] == "limit"


def test_retrieve_and_cancel_unknown_batch_404(module_server: ServerProcess) -> None:
    client = module_server.client()
    assert api_error(client.batches.retrieve, "batch_nope").status_code == 404
    assert api_error(client.batches.cancel, "batch_nope").status_code == 404


# -- create-body validation -----------------------------------------------------------------------------------

BAD_CREATES: list[tuple[str, dict[str, Any], str]] = [
    ("unknown endpoint", {"endpoint": "/v1/unknown"}, "endpoint"),
    ("moderations", {"endpoint": "/v1/moderations"}, "endpoint"),
    ("window 0h", {"completion_window": "0h"}, "completion_window"),
    ("window 169h", {"completion_window": "169h"}, "completion_window"),
    ("window 24", {"completion_window": "24"}, "completion_window"),
    ("window 1d", {"completion_window": "1d"}, "completion_window"),
    ("17 metadata pairs", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("65-char key", {"metadata": {"k" * 65: "v"}}, "metadata"),
    ("513-char value", {"metadata": {"k": "v" * 513}}, "metadata"),
    ("unknown input file", {"input_file_id": "file-doesnotexist"}, "input_file_id"),
    ("no input file", {"input_file_id": None}, "input_file_id"),
    ("no endpoint", {"endpoint": None}, "endpoint"),
    ("no window", {"completion_window": None}, "completion_window"),
    ("metadata not strings", {"metadata": {"k": 1}}, "metadata"),
    (
        "output expiry too short",
        {"output_expires_after": {"anchor": "created_at", "seconds": 3599}},
        "output_expires_after",
    ),
    (
        "output expiry too long",
        {"output_expires_after": {"anchor": "created_at", "seconds": 2_592_001}},
        "output_expires_after",
    ),
]  # a None value is left out of the body


@pytest.mark.parametrize(("case", "override", "param"), BAD_CREATES, ids=[c[0] for c in BAD_CREATES])
def test_bad_create_bodies_are_400_and_create_nothing(
    module_server: ServerProcess, case: str, override: dict[str, Any], param: str
) -> None:
    client = module_server.client()
    file_id = invalid_only_file(client)
    before = batch_ids(client)
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **override}
    body = {k: v for k, v in body.items() if v is not None}
    r = module_server.http().post("/v1/batches", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or err["param"].startswith(param + "."), err  # a nested field by its path
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    assert batch_ids(client) == before, "a refused create must create nothing"


def test_input_file_of_purpose_batch_output_is_refused(module_server: ServerProcess) -> None:
    client = module_server.client()
    done = wait_terminal(client, submit(client, jsonl([line("a", chat_body("x", max_tokens=1))])).id)
    assert done.output_file_id is not None
    exc = api_error(
        client.batches.create,
        input_file_id=done.output_file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert exc.status_code == 400
    assert error_of(exc)["param"] == "input_file_id"


def test_accepted_windows_and_metadata_echo(module_server: ServerProcess) -> None:
    client = module_server.client()
    file_id = invalid_only_file(client)
    metadata = {f"key{i}": f"value {i}" for i in range(14)}
    metadata["k" * 64] = "v" * 512
    metadata["unicode"] = "héllo ☃ 🎉"
    assert len(metadata) == 16
    created = []
    for window, hours in (("1h", 1), ("24h", 24), ("168h", 168)):
        b = client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window=window,  # type: ignore[arg-type]
            metadata=metadata,
        )
        assert b.completion_window == window
        assert b.expires_at == b.created_at + hours * 3600
        assert b.metadata == metadata
        created.append(b.id)
    for bid in created:
        assert wait_terminal(client, bid).metadata == metadata
    listed = {b.id: b for b in client.batches.list(limit=100)}
    assert all(listed[bid].metadata == metadata for bid in created)


# -- validation of input lines ---------------------------------------------------------------------------------


def test_line_validation_errors(module_server: ServerProcess) -> None:
    client = module_server.client()
    ok = chat_body("fine", max_tokens=2)
    raw: list[Any] = [
        line("ok-1", ok),  # 1
        "{not json",  # 2
        "[1, 2, 3]",  # 3
        {"method": "POST", "url": "/v1/chat/completions", "body": ok},  # 4: no custom_id
        "",  # 5: blank
        line("ok-1", ok),  # 6: duplicate
        line("get", ok, method="GET"),  # 7
        line("wrong-url", ok, url="/v1/completions"),  # 8
        "   \t ",  # 9: blank
        line("stream", chat_body("s", stream=True)),  # 10
        line("unknown-field", chat_body("u", frobnicate=1)),  # 11
        line("no-model", chat_body("m", model="no-such-model")),  # 12
        line("ok-2", ok),  # 13
        line("bad-type", chat_body("t", max_tokens="two")),  # 14
        line("no-messages", {"model": "tiny", "max_tokens": 2}),  # 15
    ]
    # line number -> (custom_id in the error line, status, code, param); None = any code accepted from the set;
    # a body field is named as OpenAI's Batch API names it (body.<field>)
    expected: dict[int, tuple[str | None, int, str | set[str], str | None]] = {
        2: (None, 400, "invalid_json_line", None),
        3: (None, 400, {"invalid_json_line", "invalid_type"}, None),
        4: (None, 400, "missing_required_parameter", "custom_id"),
        6: ("ok-1", 400, "duplicate_custom_id", "custom_id"),
        7: ("get", 400, {"invalid_value", "invalid_method"}, "method"),
        8: ("wrong-url", 400, "invalid_url", "url"),
        10: ("stream", 400, "streaming_unsupported", "body.stream"),
        11: ("unknown-field", 400, "unknown_parameter", "body.frobnicate"),
        12: ("no-model", 404, "model_not_found", "body.model"),
        14: ("bad-type", 400, {"invalid_type", "invalid_value"}, "body.max_tokens"),
        15: ("no-messages", 400, "missing_required_parameter", "body.messages"),
    }
    done = wait_terminal(client, submit(client, jsonl(raw)).id)
    assert done.status == "completed", done
    counts = done.request_counts
    assert counts is not None
    assert counts.total == 13, "blank lines are not requests"
    assert (counts.completed, counts.failed) == (2, 11)

    out = read_lines(client, done.output_file_id)
    assert [x["custom_id"] for x in out] == ["ok-1", "ok-2"]
    err_lines = read_lines(client, done.error_file_id)
    assert [x["millm"]["line"] for x in err_lines] == sorted(expected), "error lines in input order, 1-based numbers"
    listed = {e.line: e for e in (done.errors.data if done.errors else [])}  # type: ignore[union-attr]
    for x in err_lines:
        number = x["millm"]["line"]
        custom_id, status, code, param = expected[number]
        assert x["custom_id"] == custom_id, x
        assert x["id"].startswith("batch_req_")
        response = x["response"]
        body_error = response["body"]["error"]
        assert x["error"] == {"code": body_error["code"], "message": body_error["message"]}, x
        assert response["status_code"] == status, x
        assert response["request_id"]
        error = response["body"]["error"]
        assert error["code"] in ({code} if isinstance(code, str) else code), x
        assert error["param"] == param, x
        assert error["message"]
        entry = listed[number]
        assert (entry.code, entry.param, entry.message) == (error["code"], error["param"], error["message"])

    # The same body refused by the synchronous route (strict, as batch lines are): same status and error, the param
    # named inside the line's body.
    for number, body in ((11, chat_body("u", frobnicate=1)), (12, chat_body("m", model="no-such-model"))):
        exc = api_error(
            client.chat.completions.create,
            **{k: v for k, v in body.items() if k != "frobnicate"},
            extra_body={"frobnicate": 1} if "frobnicate" in body else None,
            extra_headers={"X-miLLM-Strict": "true"},
        )
        mine = next(x for x in err_lines if x["millm"]["line"] == number)
        assert exc.status_code == mine["response"]["status_code"]
        sync = error_of(exc)
        assert {**sync, "param": f"body.{sync['param']}"} == mine["response"]["body"]["error"]


def test_bom_crlf_and_blank_lines(module_server: ServerProcess) -> None:
    client = module_server.client()
    data = (
        b"\xef\xbb\xbf"
        + json.dumps(line("a", chat_body("one", max_tokens=1))).encode()
        + b"\r\n"
        + b"\r\n"
        + json.dumps(line("b", chat_body("two", max_tokens=1))).encode()
        + b"\r\n"
        + b"not json\r\n"
        + b"\n"
    )
    done = wait_terminal(client, submit(client, data).id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 2, 1)
    assert [x["custom_id"] for x in read_lines(client, done.output_file_id)] == ["a", "b"]
    err = read_lines(client, done.error_file_id)
    assert [(x["custom_id"], x["millm"]["line"]) for x in err] == [(None, 4)]
    assert err[0]["response"]["body"]["error"]["code"] == "invalid_json_line"


def test_no_valid_line_fails_the_batch(module_server: ServerProcess) -> None:
    client = module_server.client()
    unknown_model = line("x", chat_body("y", model="no-such-model"))
    data = jsonl(["{oops", unknown_model, "", line("z", chat_body("z"), method="PUT")])
    done = wait_terminal(client, submit(client, data).id)
    assert done.status == "failed"
    assert done.failed_at is not None and done.in_progress_at is None and done.completed_at is None
    assert done.output_file_id is None
    assert done.errors is not None and done.errors.data
    by_line = {e.line: e for e in done.errors.data if e.line is not None}
    assert set(by_line) == {1, 2, 4}
    assert by_line[1].code == "invalid_json_line"
    assert by_line[2].code == "model_not_found"
    assert by_line[4].param == "method"
    counts = done.request_counts
    assert counts is not None and counts.completed == 0
    assert counts.completed + counts.failed == counts.total


@pytest.mark.parametrize("data", [b"", b"\n\n   \n"], ids=["empty", "blank-lines-only"])
def test_empty_file_fails_the_batch(module_server: ServerProcess, data: bytes) -> None:
    client = module_server.client()
    done = wait_terminal(client, submit(client, data).id)
    assert done.status == "failed"
    assert done.errors is not None and done.errors.data
    assert done.failed_at is not None
    assert done.output_file_id is None
    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (0, 0, 0)


def test_model_prefix_names_the_exact_id(quantized_server: ServerProcess) -> None:
    client = quantized_server.client()
    prefix = QUANTIZED_ID.split(":")[0]
    data = jsonl(
        [
            line("prefix", chat_body("a", model=prefix)),
            line("exact", chat_body("b", model=QUANTIZED_ID, max_tokens=1)),
        ]
    )
    done = wait_terminal(client, submit(client, data).id)
    assert done.status == "completed"
    assert done.model == QUANTIZED_ID
    out, err = assert_result_files(client, done, ["prefix", "exact"])
    assert out[0]["response"]["body"]["model"] == QUANTIZED_ID
    assert out[0]["response"]["millm"]["headers"]["X-miLLM-Model"] == QUANTIZED_ID
    assert err[0]["response"]["status_code"] == 404
    error = err[0]["response"]["body"]["error"]
    assert error["code"] == "model_not_found"
    assert error["param"] == "body.model"  # OpenAI's Batch API form; the message is the synchronous route's
    assert f"'{QUANTIZED_ID}'" in error["message"] or f'"{QUANTIZED_ID}"' in error["message"], error
    assert done.errors is not None and done.errors.data[0].message == error["message"]
    sync = api_error(
        client.chat.completions.create, model=prefix, messages=[{"role": "user", "content": "a"}], max_tokens=2
    )
    assert sync.status_code == 404
    assert {**error_of(sync), "param": "body.model"} == error


# -- results ---------------------------------------------------------------------------------------------------


def test_results_order_usage_provenance_and_sync_equivalence(module_server: ServerProcess) -> None:
    client = module_server.client()
    bodies = {
        "r0": chat_body("alpha", max_tokens=3, seed=11),
        "r1": chat_body("beta", max_tokens=4, seed=12, temperature=1.0),
        "r2": chat_body(LONG_PROMPT, max_tokens=300, seed=1),  # fails on its own merits at run time
        "r3": chat_body("gamma", max_tokens=2),
        "r4": chat_body("delta", max_tokens=3, seed=13, n=2),
        "r5": {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "Be short."},
                {"role": "user", "content": [{"type": "text", "text": "eps"}]},
            ],
            "max_completion_tokens": 2,
            "seed": 14,
        },
    }
    ids = list(bodies)
    done = wait_terminal(client, submit(client, jsonl([line(cid, b) for cid, b in bodies.items()])).id)
    assert done.status == "completed", done
    out, err = assert_result_files(client, done, ids)
    assert [x["custom_id"] for x in out] == ["r0", "r1", "r3", "r4", "r5"]
    assert [x["custom_id"] for x in err] == ["r2"]

    # usage sums the output bodies' usage
    assert done.usage is not None
    assert done.usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out)
    assert done.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens

    sync_raw = client.chat.completions.with_raw_response.create(**bodies["r0"])
    for x in out:
        assert x["id"].startswith("batch_req_") and x["error"] is None
        response = x["response"]
        assert response["status_code"] == 200 and response["request_id"]
        assert response["millm"]["packed"] is False
        headers = response["millm"]["headers"]
        for name in PROVENANCE:
            assert headers.get(name), (name, headers)
        assert headers["X-miLLM-Model"] == "tiny"
        assert headers["X-miLLM-Backend"] == "serial"
        assert headers["X-miLLM-Weights"] == sync_raw.headers["x-millm-weights"]
        assert headers["X-miLLM-Dtype"] == sync_raw.headers["x-millm-dtype"]
        seed = bodies[x["custom_id"]].get("seed")
        if seed is not None:
            assert headers["X-miLLM-Seed"] == f'{seed};scope="request"'
        else:
            assert headers["X-miLLM-Seed"].endswith(';scope="server"')
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        want_choices = bodies[x["custom_id"]].get("n", 1)
        assert [c["index"] for c in body["choices"]] == list(range(want_choices))

    # The row that failed at run time carries exactly the synchronous route's status and error.
    sync_err = api_error(client.chat.completions.create, **bodies["r2"])
    assert err[0]["response"]["status_code"] == sync_err.status_code == 400
    assert err[0]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert err[0]["response"]["body"]["error"] == error_of(sync_err)
    assert err[0]["error"] == {"code": "context_length_exceeded", "message": error_of(sync_err)["message"]}

    # A row's body equals the synchronous response to the same body (same seed): choices and usage.
    for cid in ("r0", "r1", "r4", "r5"):
        sync = client.chat.completions.create(**bodies[cid]).model_dump()
        mine = next(x for x in out if x["custom_id"] == cid)["response"]["body"]
        assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in mine["choices"]] == [
            (c["index"], c["message"]["content"], c["finish_reason"]) for c in sync["choices"]
        ], cid
        assert mine["usage"]["prompt_tokens"] == sync["usage"]["prompt_tokens"]
        assert mine["usage"]["completion_tokens"] == sync["usage"]["completion_tokens"]
        assert mine["usage"]["total_tokens"] == sync["usage"]["total_tokens"]
    assert sync_raw.headers["x-millm-seed"] == '11;scope="request"'
    assert sync_raw.parse().choices[0].message.content == out[0]["response"]["body"]["choices"][0]["message"]["content"]


def test_every_row_failing_at_run_time_completes_without_output_file(module_server: ServerProcess) -> None:
    client = module_server.client()
    data = jsonl([line(f"long-{i}", chat_body(LONG_PROMPT + str(i), max_tokens=300)) for i in range(2)])
    done = wait_terminal(client, submit(client, data).id)
    assert done.status == "completed", done
    assert done.output_file_id is None
    assert done.error_file_id is not None
    _, err = assert_result_files(client, done, ["long-0", "long-1"])
    assert [x["response"]["body"]["error"]["code"] for x in err] == ["context_length_exceeded"] * 2
    assert done.usage is not None and (done.usage.input_tokens, done.usage.output_tokens) == (0, 0)


def test_completions_endpoint_batch(module_server: ServerProcess) -> None:
    client = module_server.client()
    url = "/v1/completions"
    bodies = {
        "c0": {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "seed": 21},
        "c1": {"model": "tiny", "prompt": ["one", "two"], "max_tokens": 2, "seed": 22},
        "c2": {"model": "tiny", "prompt": "x", "max_tokens": 2, "messages": []},  # unknown field in a batch line
        "c3": {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 400},  # too long, at run time
    }
    data = jsonl([line(cid, b, url=url) for cid, b in bodies.items()])
    done = wait_terminal(client, submit(client, data, endpoint=url).id)
    assert done.status == "completed", done
    assert done.endpoint == url
    out, err = assert_result_files(client, done, list(bodies))
    assert [x["custom_id"] for x in out] == ["c0", "c1"]
    assert [x["custom_id"] for x in err] == ["c2", "c3"]
    assert err[0]["response"]["body"]["error"]["code"] == "unknown_parameter"
    assert err[0]["response"]["body"]["error"]["param"] == "body.messages"
    assert err[0]["millm"]["line"] == 3
    sync_err = api_error(client.completions.create, **bodies["c3"])
    assert err[1]["response"]["status_code"] == sync_err.status_code == 400
    assert err[1]["response"]["body"]["error"] == error_of(sync_err)
    for x in out:
        body = x["response"]["body"]
        assert body["object"] == "text_completion"
        sync = client.completions.create(**bodies[x["custom_id"]]).model_dump()
        assert [c["text"] for c in body["choices"]] == [c["text"] for c in sync["choices"]]
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert {k: body["usage"][k] for k in counts} == {k: sync["usage"][k] for k in counts}
        assert x["response"]["millm"]["packed"] is False
    assert len(out[1]["response"]["body"]["choices"]) == 2
    assert done.usage is not None
    assert done.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)


# -- cancel ----------------------------------------------------------------------------------------------------


def test_cancel_in_progress(module_server: ServerProcess) -> None:
    client = module_server.client()
    ids = [f"row-{i:02d}" for i in range(60)]
    data = jsonl(
        [
            line(cid, chat_body(f"Write a long story number {i}", max_tokens=64, stop=["\u2603never\u2603"]))
            for i, cid in enumerate(ids)
        ]
    )
    batch = submit(client, data)
    wait_for(lambda: (b := client.batches.retrieve(batch.id)).request_counts.completed >= 1 and b, timeout=120)

    running = client.batches.retrieve(batch.id)
    assert running.status == "in_progress" and running.in_progress_at is not None
    assert running.request_counts is not None and running.request_counts.total == len(ids)

    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    assert cancelling.cancelling_at is not None
    again = client.batches.cancel(batch.id)  # 200, unchanged
    assert again.status in ("cancelling", "cancelled")
    assert again.cancelling_at == cancelling.cancelling_at

    done = wait_terminal(client, batch.id)
    assert done.status == "cancelled"
    assert done.cancelled_at is not None and done.cancelling_at == cancelling.cancelling_at
    assert done.completed_at is None and done.failed_at is None
    out, err = assert_result_files(client, done, ids)
    assert 1 <= len(out) < len(ids)
    assert [x["custom_id"] for x in out] == ids[: len(out)], "the recorded rows are the first ones, kept"
    assert all(x["response"]["status_code"] == 200 for x in out)
    for x in err:
        assert x["response"] is None
        assert x["error"]["code"] == "batch_cancelled"
        assert x["error"]["message"]
    assert done.usage is not None
    assert done.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)

    # cancelling a cancelled batch: 200, unchanged
    assert client.batches.cancel(batch.id) == done
    assert client.batches.retrieve(batch.id) == done


def test_cancel_right_after_create(module_server: ServerProcess) -> None:
    """A cancel while the batch validates (or has barely started) still ends with every row accounted for."""
    client = module_server.client()
    ids = [f"v{i:03d}" for i in range(200)]
    batch = submit(client, jsonl([line(cid, chat_body(cid, max_tokens=16)) for cid in ids]))
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    done = wait_terminal(client, batch.id)
    assert done.status == "cancelled"
    out, err = assert_result_files(client, done, ids)
    assert len(err) >= len(ids) - 16, "at most a chunk's worth of rows may have run"
    assert all(x["error"]["code"] == "batch_cancelled" and x["response"] is None for x in err)
    assert [x["custom_id"] for x in out] == ids[: len(out)]


def test_cancel_of_a_finished_batch_is_409(module_server: ServerProcess) -> None:
    client = module_server.client()
    completed = wait_terminal(client, submit(client, jsonl([line("a", chat_body("x", max_tokens=1))])).id)
    failed = wait_terminal(client, submit(client, b"{oops\n").id)
    assert (completed.status, failed.status) == ("completed", "failed")
    for b in (completed, failed):
        exc = api_error(client.batches.cancel, b.id)
        assert exc.status_code == 409
        assert error_of(exc)["message"]
        assert client.batches.retrieve(b.id) == b, "a refused cancel changes nothing"


def test_cancel_ends_a_long_chunk_at_the_next_row(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A chunk as long as the whole batch: a cancel still stops it at the next row boundary, not at its end."""
    rows = 100
    env = {"BATCH_CHUNK_ROWS": str(rows), "BATCH_CHUNK_SECONDS": "600"}
    with tiny_server_process(tiny_model_dir, tmp_path, env=env) as server:
        client = server.client()
        ids = [f"row-{i:03d}" for i in range(rows)]
        data = jsonl(
            [line(cid, chat_body(f"Story {i}", max_tokens=64, stop=["\u2603never\u2603"])) for i, cid in enumerate(ids)]
        )
        batch = submit(client, data)
        wait_for(lambda: (b := client.batches.retrieve(batch.id)).request_counts.completed >= 1 and b, timeout=120)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.request_counts is not None
        done = wait_terminal(client, batch.id)
        assert done.status == "cancelled"
        out, err = assert_result_files(client, done, ids)
        # at most the row running when the cancel was stored, and one recorded just before it was read, run after it
        assert len(out) <= cancelling.request_counts.completed + 2 < rows
        assert len(err) == rows - len(out) and all(x["error"]["code"] == "batch_cancelled" for x in err)
