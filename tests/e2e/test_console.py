"""The web console (issue 16) in a real browser: Playwright driving Debian's Chromium (``/usr/bin/chromium``, never
a browser download) against a real ``miserver serve`` with the tiny model, API keys and a price table.

One server and one browser for the module. The journey: a wrong key refused, sign in, upload and create a job,
watch its progress bar reach completed over the live socket, search it by description, cancel a second job,
download both files of the first and compare them with the API's bytes, read the usage page, read the Keys page
as a member, an admin and a key with one scope (which the console refuses a job's page, as the API would); no
request leaves the server. Screenshots of each page go to
``test-artifacts/console/`` (``MISERVER_ARTIFACTS_DIR`` overrides).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright import sync_api as playwright_api

from tests.e2e.test_console_layout import OVERFLOWS
from tests.support.batches import chat_body, jsonl, line, submit, wait_terminal
from tests.support.server import ServerProcess, tiny_server_process

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
PRICES = {"currency": "USD", "batch_discount": 0.5, "models": {"tiny": {"input": 2_000_000, "output": 4_000_000}}}
ENV = {"BATCH_POLL_SECONDS": "0.2", "BATCH_CHUNK_ROWS": "2", "BATCH_MAX_ROWS": "100"}
ARTIFACTS = Path(os.environ.get("MISERVER_ARTIFACTS_DIR", "test-artifacts")) / "console"


class Console:
    """The server, its keys, the SDK clients and the browser page of the module."""

    def __init__(self, server: ServerProcess, admin: str, member: dict[str, Any], page: Any) -> None:
        self.server = server
        self.admin = admin
        self.member: str = member["key"]
        self.member_id: str = member["id"]
        self.client = server.client(api_key=self.member)
        self.page = page
        self.requests: list[str] = []
        self.batches: dict[str, str] = {}

    def url(self, path: str) -> str:
        return self.server.base_url + path

    def shot(self, name: str, page: Any = None) -> None:
        """A full-page screenshot of ``page`` (the module's page by default) as ``<name>.png``."""
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (page or self.page).screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


@pytest.fixture(scope="module")
def console(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    root = tmp_path_factory.mktemp("console")
    prices = root / "prices.json"
    prices.write_text(json.dumps(PRICES))
    env = {**ENV, "MISERVER_PRICES_FILE": str(prices)}
    with tiny_server_process(tiny_model_dir, root, env=env) as server:
        http = server.http()
        admin = http.post("/api/keys", json={"name": "root", "admin": True}).json()["key"]
        member = http.post("/api/keys", json={"name": "analyst"}, headers={"Authorization": f"Bearer {admin}"}).json()
        assert Path(CHROMIUM).exists(), "Debian's chromium is missing: make test installs it (apt-get install chromium)"
        with playwright_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            context = browser.new_context(accept_downloads=True, viewport={"width": 1280, "height": 800})
            page = context.new_page()
            page.set_default_timeout(30_000)
            state = Console(server, admin, member, page)
            page.on("request", lambda request: state.requests.append(request.url))
            try:
                yield state
            finally:
                context.close()
                browser.close()


def _input_file(n: int, prefix: str, max_tokens: int = 4, bad: int = 0) -> bytes:
    rows: list[dict[str, Any] | str] = [
        line(f"{prefix}{i}", chat_body(f"Say {i}", max_tokens=max_tokens)) for i in range(n)
    ]
    rows += [line(f"{prefix}-bad{i}", chat_body("x"), url="/v1/embeddings") for i in range(bad)]
    return jsonl(rows)


def test_sign_in_refuses_a_wrong_key_then_accepts_the_right_one(console: Console) -> None:
    page = console.page
    page.goto(console.url("/console/"))
    assert page.url.startswith(console.url("/console/signin"))
    page.get_by_label("API key").fill("sk-not-a-key")
    page.get_by_role("button", name="Sign in").click()
    assert "incorrect" in page.locator("#signin-message").inner_text()
    console.shot("signin-refused")
    page.get_by_label("API key").fill(console.member)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(console.url("/console/"))
    cookie = next(c for c in page.context.cookies() if c["name"] == "miserver_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert console.member not in cookie["value"]


def test_upload_create_and_watch_progress_reach_completed(console: Console, tmp_path: Path) -> None:
    page = console.page
    page.goto(console.url("/console/batches/new"))
    source = tmp_path / "nightly.jsonl"
    source.write_bytes(_input_file(5, "n", bad=1))
    page.set_input_files("#file", str(source))
    page.locator("#create-button:not([disabled])").wait_for()  # the upload answered: a file id is set
    assert "6 request lines" in page.locator("#file-info").inner_text()
    page.locator("#estimate", has_text="Estimated cost").wait_for()
    page.get_by_label("Description").fill("nightly eval of the tiny model")
    page.get_by_label("Maximum wait").select_option("48")
    console.shot("create")
    page.get_by_role("button", name="Create").click()
    page.wait_for_url(re.compile(r".*/console/batches/batch_[0-9a-f]+$"))
    batch_id = page.url.rsplit("/", 1)[1]
    console.batches["first"] = batch_id
    created = console.client.batches.retrieve(batch_id)
    assert created.metadata == {"description": "nightly eval of the tiny model"}
    assert created.completion_window == "48h"
    page.goto(console.url("/console/"))
    page.locator("html[data-live=socket]").wait_for(state="attached")  # live over the socket, no polling
    row = page.locator(f'tr[data-batch-id="{batch_id}"]')
    row.locator('[data-field="status"]', has_text="completed").wait_for()
    bar = row.locator("progress")
    assert bar.get_attribute("value") == bar.get_attribute("max") == "6"
    assert "6 / 6" in row.inner_text()
    console.shot("jobs")


def test_a_refused_upload_shows_the_limit_and_the_measured_value(console: Console, tmp_path: Path) -> None:
    page = console.page
    page.goto(console.url("/console/batches/new"))
    source = tmp_path / "big.jsonl"
    source.write_bytes(_input_file(101, "b"))
    page.set_input_files("#file", str(source))
    error = page.locator("#upload-error")
    error.wait_for()
    text = error.inner_text()
    assert text.startswith("Upload refused:") and "100" in text and "101" in text, text
    assert page.locator("#create-button").is_disabled()


def test_search_by_description(console: Console) -> None:
    page = console.page
    other = submit(console.client, _input_file(2, "o"), metadata={"description": "weekly regression"})
    wait_terminal(console.client, other.id)
    page.goto(console.url("/console/"))
    page.get_by_label("Search description or id").fill("NIGHTLY")
    page.get_by_role("button", name="Search").click()
    page.wait_for_url(re.compile(r".*[?&]q=NIGHTLY"))
    ids = page.locator("tr[data-batch-id]").evaluate_all("rows => rows.map(r => r.dataset.batchId)")
    assert ids == [console.batches["first"]]
    page.goto(console.url(f"/console/?q={other.id[-8:]}"))
    assert page.locator("tr[data-batch-id]").evaluate_all("rows => rows.map(r => r.dataset.batchId)") == [other.id]


def test_cancel_a_second_job(console: Console) -> None:
    page = console.page
    second = submit(console.client, _input_file(50, "c", max_tokens=16), metadata={"description": "to cancel"})
    paused = console.server.http().post(
        f"/v1/batches/{second.id}/pause", headers={"Authorization": f"Bearer {console.member}"}
    )
    assert paused.status_code == 200, paused.text  # it waits (paused) until the console cancels it
    page.goto(console.url("/console/?q=to+cancel"))
    row = page.locator(f'tr[data-batch-id="{second.id}"]')
    row.get_by_role("button", name=f"Cancel {second.id}").click()
    page.wait_for_url(re.compile(r".*q=to\+cancel.*"))
    done = wait_terminal(console.client, second.id)
    assert done.status == "cancelled"
    page.locator(f'tr[data-batch-id="{second.id}"] [data-field="status"]', has_text="cancelled").wait_for()
    assert done.request_counts is not None and done.request_counts.completed < 50
    page.goto(console.url("/console/"))
    console.shot("jobs-all")  # the picture of the job list in docs/console.md (docs/images/console-jobs.png)


def test_download_both_files_equal_the_api_bytes(console: Console) -> None:
    page = console.page
    batch = console.client.batches.retrieve(console.batches["first"])
    assert batch.output_file_id and batch.error_file_id
    page.goto(console.url(f"/console/batches/{batch.id}"))
    for name, file_id in (("Success file", batch.output_file_id), ("Error file", batch.error_file_id)):
        with page.expect_download() as info:
            page.get_by_role("link", name=re.compile(name)).click()
        got = Path(info.value.path()).read_bytes()
        assert got == console.client.files.content(file_id).content
    console.shot("detail")
    page.get_by_role("link", name="Results").click()
    page.get_by_label("custom_id").fill("n3")
    page.get_by_role("button", name="Find").click()
    assert page.locator("#results tbody tr").count() == 1
    assert "n3" in page.locator("#results tbody").inner_text()


def test_a_download_named_in_any_script_keeps_its_name_on_both_routes(console: Console) -> None:
    """A file named outside Latin-1 downloads (200, not 500) from the console and from the API, under its own name
    (RFC 6266 ``filename*``) with an ASCII fallback, and the keep-alive connection serves the next request."""
    name = "données_測試_😀.jsonl"
    data = jsonl([line("u1", chat_body("hello", max_tokens=1))])
    uploaded = console.client.files.create(file=(name, data), purpose="batch")
    got = console.page.request.get(console.url(f"/console/files/{uploaded.id}/content"))
    assert got.status == 200 and got.body() == data
    with httpx.Client(base_url=console.server.base_url, headers={"Authorization": f"Bearer {console.member}"}) as http:
        api = http.get(f"/v1/files/{uploaded.id}/content")
        again = http.get(f"/v1/files/{uploaded.id}")
    assert api.status_code == 200 and api.content == data and again.status_code == 200
    for disposition in (got.headers["content-disposition"], api.headers["content-disposition"]):
        fallback = re.fullmatch(r'attachment; filename="([^"]*)"; filename\*=UTF-8\'\'(\S+)', disposition)
        assert fallback, disposition
        assert fallback.group(1).isascii() and fallback.group(1).endswith(".jsonl")
        assert urllib.parse.unquote(fallback.group(2)) == name


def test_usage_page(console: Console) -> None:
    page = console.page
    page.goto(console.url("/console/usage?kind=batch"))
    totals = page.locator("#totals").inner_text()
    assert re.search(r"Requests\s+\d+", totals) and not re.search(r"Requests\s+0\b", totals)
    assert page.locator("svg.chart rect").count() >= 1
    assert "saved" in page.locator("#saved").inner_text().lower()
    assert page.locator("#usage-table tbody tr").count() >= 1
    console.shot("usage")
    with page.expect_download() as info:
        page.get_by_role("link", name="Export CSV").click()
    rows = Path(info.value.path()).read_text().splitlines()
    assert rows[0] == "day,model,requests,input_tokens,output_tokens,cost" and len(rows) >= 2


@contextlib.contextmanager
def _signed_in(console: Console, key: str, width: int = 1280, lands: str = "/console/") -> Iterator[Any]:
    """A page of a fresh browser context signed in with ``key`` (apart from the module's page and its cookie), on
    the page sign-in ``lands`` on (the Usage page for a key without ``batches``)."""
    context = console.page.context.browser.new_context(viewport={"width": width, "height": 800})
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        page.goto(console.url("/console/signin"))
        page.get_by_label("API key").fill(key)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(console.url(lands))
        yield page
    finally:
        context.close()


def _key_rows(page: Any) -> dict[str, dict[str, str]]:
    """The Keys table of ``page``: key id -> ``{scopes, grant, revoked}`` as the page reads them."""
    rows: dict[str, dict[str, str]] = {}
    for row in page.locator("#keys tbody tr").all():
        fields = {f: row.locator(f'[data-field="{f}"]') for f in ("scope-list", "grant", "revoked")}
        shown = {f: loc.inner_text().strip() if loc.count() else "" for f, loc in fields.items()}
        rows[str(row.get_attribute("data-key-id"))] = {
            "scopes": shown["scope-list"],
            "grant": shown["grant"],
            "revoked": shown["revoked"],
        }
    return rows


def _assert_no_secret(html: str, *keys: str) -> None:
    """No 12 characters in a row of any of ``keys`` (the shown prefix is 11) nor of its SHA-256 digest are in
    ``html``."""
    for key in keys:
        for text in (key, hashlib.sha256(key.encode()).hexdigest()):
            leaked = [text[i : i + 12] for i in range(len(text) - 11) if text[i : i + 12] in html]
            assert leaked == [], leaked


def _assert_fits(page: Any, name: str) -> None:
    measured = page.evaluate(OVERFLOWS)
    assert measured["page"] <= 0 and measured["found"] == [], (name, measured)


def test_a_member_sees_only_its_own_key_with_its_scopes(console: Console) -> None:
    page = console.page
    page.goto(console.url("/console/"))
    page.get_by_role("navigation", name="Console").get_by_role("link", name="Keys").click()
    page.wait_for_url(console.url("/console/keys"))
    rows = _key_rows(page)
    assert list(rows) == [console.member_id]
    assert rows[console.member_id]["scopes"] == "inference, batches, files"
    assert rows[console.member_id]["grant"] == "(member default)"
    assert page.locator("#keys th", has_text="Revoked").count() == 0
    text = page.locator("main").inner_text()
    assert "analyst" in text and "root" not in text
    html = page.request.get(console.url("/console/keys")).text()
    assert console.member_id in html and console.admin[:11] not in html  # not even the admin key's prefix
    _assert_no_secret(html, console.member, console.admin)
    console.shot("keys-member")


def test_an_admin_sees_every_key_and_a_scoped_key_its_one_scope(console: Console) -> None:
    http = console.server.http()
    admin = {"Authorization": f"Bearer {console.admin}"}
    made = http.post("/api/keys", json={"name": "scoped", "scopes": ["inference"]}, headers=admin).json()
    retired = http.post("/api/keys", json={"name": "retired"}, headers=admin).json()
    assert http.post(f"/api/keys/{retired['id']}/revoke", headers=admin).status_code == 200
    every = http.get("/api/keys", headers=admin).json()["data"]
    root_id = next(k["id"] for k in every if k["name"] == "root")
    with _signed_in(console, console.admin) as page:
        page.goto(console.url("/console/keys"))
        rows = _key_rows(page)
        assert list(rows) == [k["id"] for k in every]  # every key, oldest first, revoked ones too
        assert rows[root_id]["scopes"] == "inference, batches, files, models:write, admin"
        assert rows[root_id]["grant"] == "(admin key: every scope)"
        assert rows[console.member_id]["grant"] == "(member default)"
        assert rows[made["id"]] == {"scopes": "inference", "grant": "(chosen when made)", "revoked": "no"}
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", rows[retired["id"]]["revoked"])
        assert rows[console.member_id]["revoked"] == "no"
        html = page.request.get(console.url("/console/keys")).text()
        _assert_no_secret(html, console.admin, console.member, made["key"], retired["key"])
        console.shot("keys-admin", page)
        _assert_fits(page, "keys-admin-1280")
        page.set_viewport_size({"width": 390, "height": 844})
        _assert_fits(page, "keys-admin-390")
        console.shot("keys-admin-phone", page)
    with _signed_in(console, made["key"], lands="/console/usage") as page:
        page.goto(console.url("/console/keys"))
        assert _key_rows(page) == {made["id"]: {"scopes": "inference", "grant": "(chosen when made)", "revoked": ""}}
        _assert_no_secret(page.request.get(console.url("/console/keys")).text(), made["key"], console.admin)
        nav = page.get_by_role("navigation", name="Console")
        assert nav.get_by_role("link").all_inner_texts() == ["Usage", "Keys"]  # only what its scopes allow
        answer = page.goto(console.url(f"/console/batches/{console.batches['first']}"))
        assert answer is not None and answer.status == 403
        assert "lacks the 'batches' scope" in page.get_by_role("alert").inner_text()
        console.shot("scope-refused", page)


def test_phone_width_and_no_request_leaves_the_server(console: Console) -> None:
    page = console.page
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(console.url("/console/"))
    console.shot("jobs-phone")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390 + 1
    page.set_viewport_size({"width": 1280, "height": 800})
    assert console.requests
    outside = [u for u in console.requests if not u.startswith((console.server.base_url, "ws://127.0.0.1", "data:"))]
    assert outside == []


def test_an_admin_sees_every_key_with_a_key_filter(console: Console) -> None:
    http = console.server.http()
    form = http.get("/console/signin")
    token = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert token is not None
    signed = http.post("/console/signin", data={"csrf": token.group(1), "api_key": console.admin, "next": "/console/"})
    assert signed.status_code == 303
    mine = console.client.batches.list(limit=100).data
    every = http.get("/console/")
    assert 'id="key"' in every.text and "analyst" in every.text  # the key filter lists the keys
    assert all(b.id in every.text for b in mine)
    filtered = http.get("/console/", params={"key": console.member_id})
    assert f"{len(mine)} jobs" in filtered.text
    assert http.get("/console/", params={"key": "key_nobody"}).text.count("data-batch-id=") == 0
    out = http.post("/console/signout", data={"csrf": re.findall(r'name="csrf" value="([^"]+)"', every.text)[0]})
    assert out.status_code == 303 and http.get("/console/").status_code == 303  # signed out: back to sign-in


def test_served_pages_name_no_other_host_and_wrong_keys_are_limited(console: Console) -> None:
    http = console.server.http()
    signed = httpx.Client(base_url=console.server.base_url)
    for c in console.page.context.cookies():
        signed.cookies.set(c["name"], c["value"])
    pages = ["/console/", "/console/batches/new", "/console/usage", "/console/keys"]
    pages += [f"/console/batches/{console.batches['first']}"]
    pages += ["/console/static/console.js", "/console/static/console.css", "/console/signin"]
    for path in pages:
        answer = signed.get(path)
        assert answer.status_code == 200, path
        assert answer.headers["content-security-policy"].startswith("default-src 'self'")
        assert re.findall(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", answer.text, re.I) == [], path
    signed.close()
    # five wrong keys from one address, then the sixth is refused with 429 (last test: the address stays limited)
    answer = http.get("/console/signin")
    codes = []
    for i in range(6):
        token = re.search(r'name="csrf" value="([^"]+)"', answer.text)  # each form has its own token
        assert token is not None
        data = {"csrf": token.group(1), "api_key": f"sk-wrong{i}", "next": "/console/"}
        answer = http.post("/console/signin", data=data)
        codes.append(answer.status_code)
    assert codes == [401] * 5 + [429]
    assert "Too many wrong keys" in answer.text and int(answer.headers["retry-after"]) > 0
