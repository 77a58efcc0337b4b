"""Issue 18, item 2: schemathesis against a real ``miserver serve`` on the tiny model, every documented operation of
``/openapi.json``, with the checks ``not_a_server_error``, ``status_code_conformance``, ``content_type_conformance``,
``response_schema_conformance`` and ``negative_data_rejection``: 0 failures. And ``/docs`` works offline.

Schemathesis runs as its command line (``st run``; its pytest plugin does not run under pytest 9), with a fixed
seed: the coverage phase (each field's boundaries and wrong types, derived from the schema) and the fuzzing phase
(a few Hypothesis examples per operation, valid and invalid data), bounded by ``--max-time``. Its JSON report gives
the counts; a failure shows schemathesis's own report (each failing case with its curl command).

Left out, each with its reason in :data:`LEFT_OUT`: the operations that change what every later case would meet
(the resident model, its weights, the API keys) or that reach outside this machine (webhook deliveries to generated
URLs). Every other operation is fuzzed: ``tests/unit/test_openapi.py`` checks that every route is documented.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from miserver.api.openapi import STATIC_FILES, STATIC_PREFIX
from tests.support.batches import read_lines, submit, wait_terminal
from tests.support.fuzz_lines import ENDPOINT, MODEL, Line, batch_file, param_problem
from tests.support.server import ServerProcess, tiny_server_process

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
    ]
)
#: Operations left out of the fuzzing, with the reason (those that exist in the document are excluded by name).
LEFT_OUT = {
    "POST /api/models/load": "swaps the resident model: a generated name unloads the tiny model, then fails to load",
    "POST /api/models/unload": "leaves no resident model: every later inference case would be a 503",
    "POST /api/models": "adds generated paths to the model catalogue",
    "POST /api/weights/begin": "tears the resident weights: every later inference case would be refused",
    "POST /api/weights/write": "writes generated tensors into the resident weights",
    "POST /api/weights/commit": "ends a weights write (see begin)",
    "POST /api/weights/abort": "ends a weights write (see begin)",
    "POST /api/checkpoints": "saves the resident weights to disk under a generated id (hundreds of files)",
    "POST /api/keys": "the first API key turns authentication on: every later case would be a 401",
    "POST /api/webhooks": "deliveries would go to generated URLs, off this machine",
}
#: The run's bounds: examples per operation and mode in the fuzzing phase, and the whole run's time budget.
MAX_EXAMPLES = 8
MAX_SECONDS = 30
SEED = 18
#: The fuzzed model's context in tokens (see ``fuzz_server``).
CONTEXT = 128
VENDORED = ROOT / "src/miserver/api/static/swagger-ui/VENDORED.md"


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny model with a context of :data:`CONTEXT` tokens, served as ``tiny`` on SQLite, for this module alone
    (the fuzzing leaves leases and probes behind). A generated request that sets no ``max_tokens`` generates up to
    the context's end: with 128 positions instead of 512 such a case costs a fraction of a second, not seconds."""
    root = tmp_path_factory.mktemp("schema-fuzz")
    model = shutil.copytree(tiny_model_dir, root / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    with tiny_server_process(model, root) as server:
        yield server


def _left_out(document: dict[str, Any]) -> list[str]:
    """``METHOD /path`` of each operation of :data:`LEFT_OUT` (each must still be in the document)."""
    names = [f"{method.upper()} {path}" for path, item in document["paths"].items() for method in item]
    gone = sorted(set(LEFT_OUT) - set(names))
    assert not gone, f"no longer in the document, remove from LEFT_OUT: {gone}"
    return [name for name in names if name in LEFT_OUT]


def test_schemathesis_finds_no_failure(fuzz_server: ServerProcess, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    document = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=30).json()
    excluded = _left_out(document)
    command = [
        str(Path(sys.executable).parent / "st"),
        "run",
        f"{fuzz_server.base_url}/openapi.json",
        "--checks",
        CHECKS,
        "--phases",
        "coverage,fuzzing",
        "--mode",
        "all",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--max-time",
        str(MAX_SECONDS),
        "--seed",
        str(SEED),
        "--request-timeout",
        "60",
        "--workers",
        "1",
        "--no-color",
        "--report",
        "json",
        "--report-json-path",
        str(report),
    ]
    for name in excluded:
        command += ["--exclude-name", name]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.support.schema_hooks", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=MAX_SECONDS + 120)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    summary = json.loads(report.read_text())
    print({key: summary[key] for key in ("operations", "test_cases", "running_time", "stop_reason")})  # with -s
    assert summary["operations"]["tested"] == summary["operations"]["selected"] >= 38
    assert summary["operations"]["selected"] == summary["operations"]["total"] - len(excluded)
    assert summary["test_cases"]["with_failures"] == summary["test_cases"]["errored"] == 0
    assert summary["test_cases"]["generated"] >= 500


def test_docs_page_loads_nothing_from_another_host(fuzz_server: ServerProcess) -> None:
    """``/docs`` is Swagger UI from the package: every asset it names is served here, byte for byte the vendored
    files whose checksums ``VENDORED.md`` records, and the page names no other host."""
    with httpx.Client(base_url=fuzz_server.base_url, timeout=30) as http:
        page = http.get("/docs")
        assert page.status_code == 200, page.text
        assert page.headers["content-type"].startswith("text/html")
        urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", page.text) + re.findall(
            r"""url\s*:\s*['"]([^'"]+)['"]""", page.text
        )
        assert urls, page.text
        assert not [u for u in urls if "//" in u], f"the page names another host: {urls}"
        assert '"validatorUrl": null' in page.text  # no call to a validator service
        recorded = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{64})` \|$", VENDORED.read_text(), flags=re.M))
        assert set(recorded) == set(STATIC_FILES)
        for name, media in STATIC_FILES.items():
            assert f"{STATIC_PREFIX}/{name}" in urls
            asset = http.get(f"{STATIC_PREFIX}/{name}")
            assert asset.status_code == 200
            assert asset.headers["content-type"].startswith(media)
            assert hashlib.sha256(asset.content).hexdigest() == recorded[name], name
        document = http.get("/openapi.json")
        assert document.status_code == 200
        assert document.json()["info"]["title"] == "miServer"
        assert http.get("/redoc").status_code == 404  # ReDoc loads from a CDN: turned off


# -- issue 18, item 3, through a real server: one small fuzzed batch, and the synchronous route beside it -----------


def _release_live_lease(server: ServerProcess) -> None:
    """Release the model lease if a holder has one (a batch would wait with ``lease_unavailable``)."""
    http = server.http()
    live = http.get("/api/lease").json().get("lease")
    if live:
        assert http.post(f"/api/lease/{live}/release").status_code == 200


def _line_fields_fine(line: Line) -> bool:
    obj = line.obj
    return (
        obj is not None
        and set(obj) == {"custom_id", "method", "url", "body"}
        and isinstance(obj["custom_id"], str)
        and 0 < len(obj["custom_id"]) <= 64
        and obj["method"] == "POST"
        and obj["url"] == ENDPOINT
        and isinstance(obj["body"], dict)
        and obj["body"].get("stream") is not True
    )


@settings(
    max_examples=2,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.generate],  # no shrinking: each step would be another batch; the failing file is printed whole
    suppress_health_check=list(HealthCheck),
)
@given(lines=batch_file(min_lines=8, max_lines=14))
def test_a_fuzzed_batch_file_runs_every_valid_line_and_names_every_bad_one(
    fuzz_server: ServerProcess, lines: list[Line]
) -> None:
    """The batch completes (one bad line never fails it); every unmutated line has its output line (they fit the
    128-token context); every refused
    line is in the error file with its line number, a code and a param naming a field of the line; the same body
    sent to the synchronous route (strict mode) gets the same status, code and param; the log has no unhandled
    error."""
    client = fuzz_server.client()
    _release_live_lease(fuzz_server)  # the schema fuzzing takes leases for generated holders
    log_before = len(fuzz_server.log(10**8))
    batch = wait_terminal(client, submit(client, b"\n".join(line.raw for line in lines) + b"\n").id, timeout=300)
    assert batch.status == "completed", batch.errors
    assert batch.request_counts is not None and batch.request_counts.total == len(lines)
    outputs = {o["custom_id"]: o for o in read_lines(client, batch.output_file_id)}
    errors = read_lines(client, batch.error_file_id)
    assert len(outputs) + len(errors) == len(lines)
    refused_at = {e["millm"]["line"] for e in errors if e.get("millm")}  # refused when validated: line numbers
    for number, line in enumerate(lines, start=1):
        if line.valid:
            assert line.obj is not None
            assert outputs[line.obj["custom_id"]]["response"]["status_code"] == 200, line.mutation
        elif line.valid is False:
            assert number in refused_at, f"line {number} ({line.mutation}) is not in the error file by number"
    sync = fuzz_server.http()
    for error_line in errors:
        response = error_line["response"]
        number = (error_line.get("millm") or {}).get("line")
        line = (
            lines[number - 1]
            if number
            else next(x for x in lines if x.obj and x.obj["custom_id"] == error_line["custom_id"])
        )
        where = f"line {number} ({line.mutation}): {line.raw[:200]!r}"
        assert line.valid is not True, f"{where} did not run: {error_line}"
        error = response["body"]["error"]
        assert error_line["error"]["code"] == error["code"], where
        assert param_problem(line, error["code"], error["param"]) is None, f"{where}: {error}"
        if _line_fields_fine(line) and line.obj is not None:
            answer = sync.post(ENDPOINT, json=line.obj["body"], headers={"X-miLLM-Strict": "true"})
            got = (answer.status_code, answer.json()["error"]["code"], answer.json()["error"]["param"])
            assert got == (response["status_code"], error["code"], error["param"]), where
    log = fuzz_server.log(10**8)[log_before:]
    assert "unhandled error" not in log and "Traceback" not in log, log[-5000:]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}),
        ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 16}),
        ("/anthropic/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ],
)
def test_a_vanishing_temperature_is_greedy(fuzz_server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    """Found by the fuzzing (``tests/unit/test_fuzz_findings.py``): a temperature of 1e-300 was a 500. It answers
    what temperature 0 answers."""
    http = fuzz_server.http()
    tiny = http.post(path, json={**body, "temperature": 1e-300})
    greedy = http.post(path, json={**body, "temperature": 0})
    assert tiny.status_code == greedy.status_code == 200, tiny.text
    text = {
        "/v1/chat/completions": lambda r: r["choices"][0]["message"]["content"],
        "/v1/completions": lambda r: r["choices"][0]["text"],
        "/v1/responses": lambda r: r["output"][0]["content"][0]["text"],
        "/anthropic/v1/messages": lambda r: r["content"][0]["text"],
    }[path]
    assert text(tiny.json()) == text(greedy.json())
