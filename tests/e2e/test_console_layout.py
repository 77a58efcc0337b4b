"""The console at a laptop's width (1280 x 800) and a phone's (390 x 844), in Debian's chromium: no page scrolls
sideways and no element overflows its box, with a real model's long name in the job list and the Job card; and the
words of the pages (a count of one line, sizes people read, the pack option, a server with no price table)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright import sync_api as playwright_api

from tests.support.batches import chat_body, jsonl, line, wait_terminal
from tests.support.server import ServerProcess, tiny_server_process

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: The embedded model's id: the longest name a job list shows in practice.
LONG_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"
ARTIFACTS = Path(os.environ.get("MISERVER_ARTIFACTS_DIR", "test-artifacts")) / "console"
WIDTHS = {"laptop": (1280, 800), "phone": (390, 844)}

#: Every element whose box reaches past the viewport, or that scrolls (or clips) its own content sideways (but those
#: hidden on purpose: a file input shown through its label).
OVERFLOWS = """() => {
  const width = document.documentElement.clientWidth;
  const found = [];
  for (const el of document.querySelectorAll("body *")) {
    const box = el.getBoundingClientRect();
    if (box.width === 0 || box.height === 0 || el.closest(".visually-hidden")) continue;  // hidden on purpose
    const name = el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") + (el.className ? "." + el.className : "");
    if (box.right > width + 1) found.push(name + " ends at " + Math.round(box.right) + " of " + width);
    const style = getComputedStyle(el);
    if (style.overflowX !== "visible" && el.scrollWidth > el.clientWidth + 1)
      found.push(name + " holds " + el.scrollWidth + " in " + el.clientWidth);
  }
  return {page: document.documentElement.scrollWidth - width, found: found.slice(0, 12)};
}"""


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {"BATCH_POLL_SECONDS": "0.2"}
    root = tmp_path_factory.mktemp("console-layout")
    with tiny_server_process(tiny_model_dir, root, served_model_name=LONG_MODEL, env=env) as started:
        yield started


@pytest.fixture(scope="module")
def batch(server: ServerProcess) -> Any:
    client = server.client()
    rows = [line("ok", chat_body("hi", model=LONG_MODEL)), line("bad", chat_body("x", model=LONG_MODEL, n=0))]
    uploaded = client.files.create(
        file=("a-rather-long-input-file-name-for-the-job-card.jsonl", jsonl(rows)), purpose="batch"
    )
    created = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"description": "nightly classification of the support inbox"},
    )
    return wait_terminal(client, created.id)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: make test installs it (apt-get install chromium)"
    with playwright_api.sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.mark.parametrize("width", list(WIDTHS))
def test_every_page_fits_the_window(server: ServerProcess, batch: Any, browser: Any, width: str) -> None:
    w, h = WIDTHS[width]
    context = browser.new_context(viewport={"width": w, "height": h})
    page = context.new_page()
    try:
        for name, path in (
            ("jobs", "/console/"),
            ("detail", f"/console/batches/{batch.id}"),
            ("results", f"/console/batches/{batch.id}?tab=results"),
            ("create", "/console/batches/new"),
            ("usage", "/console/usage"),
            ("keys", "/console/keys"),
        ):
            page.goto(server.base_url + path)
            measured = page.evaluate(OVERFLOWS)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"layout-{name}-{w}.png"), full_page=True)
            assert measured["page"] <= 0, (name, w, measured)
            assert measured["found"] == [], (name, w, measured["found"])
    finally:
        context.close()


def test_the_words_of_the_pages(server: ServerProcess, batch: Any, browser: Any) -> None:
    assert batch.request_counts is not None and batch.request_counts.failed == 1
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    try:
        page.goto(server.base_url + f"/console/batches/{batch.id}")
        assert page.get_by_role("link", name="Error file (1 line)").count() == 1
        assert "not priced" in page.locator("main").inner_text() and "0.0000" not in page.locator("main").inner_text()
        page.goto(server.base_url + "/console/")
        assert "not priced" in page.locator("#jobs").inner_text()
        page.goto(server.base_url + "/console/batches/new")
        hint = page.locator("#drop-help").inner_text()
        assert "MiB per file" in hint and "bytes per file" not in hint, hint
        assert "generation" in page.locator("label[for=pack]").inner_text()
        page.goto(server.base_url + "/console/usage")
        assert "not priced" in page.locator("#totals").inner_text()
    finally:
        context.close()
