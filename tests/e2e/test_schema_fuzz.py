"""Issue 18, item 2: schemathesis against a real ``miserver serve`` on the tiny model, every documented operation of
``/openapi.json``, with the checks ``not_a_server_error``, ``status_code_conformance``, ``content_type_conformance``,
``response_schema_conformance`` and ``negative_data_rejection``: 0 failures. And ``/docs`` works offline.

Schemathesis runs as its command line (``st run``; its pytest plugin does not run under pytest 9), with a fixed
seed: the coverage phase (each field's boundaries and wrong types, derived from the schema) and the fuzzing phase
(a few Hypothesis examples per operation, valid and invalid data), bounded by ``--max-time``. Its JSON report gives
the counts; a failure shows schemathesis's own report (each failing case with its curl command).

Left out, each with its reason in :data:`LEFT_OUT`: the operations that change what every later case would meet
(the resident model, its weights, the API keys) or that reach outside this machine (webhook deliveries to generated
URLs); and any operation not yet documented with ``@documented`` (``tests/unit/test_openapi.py`` lists those).
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

from miserver.api.openapi import STATIC_FILES, STATIC_PREFIX
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
    "POST /api/checkpoints/load": "swaps the resident weights",
    "POST /api/keys": "the first API key turns authentication on: every later case would be a 401",
    "POST /api/webhooks": "deliveries would go to generated URLs, off this machine",
}
#: The run's bounds: examples per operation and mode in the fuzzing phase, and the whole run's time budget.
MAX_EXAMPLES = 8
MAX_SECONDS = 60
SEED = 18
#: The fuzzed model's context in tokens (see ``fuzz_server``).
CONTEXT = 64
VENDORED = ROOT / "src/miserver/api/static/swagger-ui/VENDORED.md"


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny model with a context of :data:`CONTEXT` tokens, served as ``tiny`` on SQLite, for this module alone
    (the fuzzing leaves leases and probes behind). A generated request that sets no ``max_tokens`` generates up to
    the context's end: with 64 positions instead of 512 such a case costs a fraction of a second, not many."""
    root = tmp_path_factory.mktemp("schema-fuzz")
    model = shutil.copytree(tiny_model_dir, root / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    with tiny_server_process(model, root) as server:
        yield server


def _left_out(document: dict[str, Any]) -> list[str]:
    """``METHOD /path`` of each operation to exclude: those of :data:`LEFT_OUT` and those not documented yet (no
    error responses: ``@documented`` writes at least 400 and 500)."""
    names = []
    for path, item in document["paths"].items():
        for method, operation in item.items():
            name = f"{method.upper()} {path}"
            if name in LEFT_OUT or "400" not in operation.get("responses", {}):
                names.append(name)
    return names


def test_schemathesis_finds_no_failure(fuzz_server: ServerProcess, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    document = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=30).json()
    excluded = _left_out(document)
    command = [
        str(Path(sys.executable).parent / "st"), "run", f"{fuzz_server.base_url}/openapi.json",
        "--checks", CHECKS, "--phases", "coverage,fuzzing", "--mode", "all",
        "--max-examples", str(MAX_EXAMPLES), "--max-time", str(MAX_SECONDS), "--seed", str(SEED),
        "--request-timeout", "60", "--workers", "1", "--no-color",
        "--report", "json", "--report-json-path", str(report),
    ]  # fmt: skip
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
