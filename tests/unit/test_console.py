"""The console's pure parts: the VENDOR list of static files and their checksums, sessions and their expiry, the
wrong-key limit, redirect targets, window choices, money, the usage chart (zero-filled days) and a Keys page row."""

from __future__ import annotations

import hashlib
from importlib import resources

from miserver.console.app import CSP
from miserver.console.pages.create import window_choices
from miserver.console.pages.keys import key_row
from miserver.console.pages.render import count, money, size, window_label
from miserver.console.pages.usage import chart
from miserver.console.sessions import FailureLimit, Sessions
from miserver.console.state import safe_next
from miserver.services.batch_api.job_search import UsageGrid, realtime_equivalent
from miserver.store.keys import KeyRecord


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_vendor_lists_every_static_file_with_its_checksum() -> None:
    static = resources.files("miserver.console") / "static"
    listed: dict[str, str] = {}
    for raw in (static / "VENDOR").read_text().splitlines():
        if raw.strip() and not raw.startswith("#"):
            name, version, licence, origin, sha = (part.strip() for part in raw.split("|"))
            assert version and licence and origin
            listed[name] = sha
    served = {p.name for p in static.iterdir() if p.name != "VENDOR"}
    assert set(listed) == served
    for name, sha in listed.items():
        assert hashlib.sha256((static / name).read_bytes()).hexdigest() == sha, f"{name} changed: update VENDOR"


def test_static_files_name_no_other_host() -> None:
    static = resources.files("miserver.console") / "static"
    templates = resources.files("miserver.console") / "templates"
    for folder in (static, templates):
        for item in folder.iterdir():
            text = item.read_text()
            assert "http://" not in text and "https://" not in text, item.name
    assert CSP.startswith("default-src 'self'")


def test_sessions_expire_renew_and_drop() -> None:
    clock = Clock()
    sessions = Sessions(clock=clock, lifetime=100)
    a = sessions.create("key_a")
    assert a.token != a.csrf and len(a.token) >= 40
    clock.now += 90
    assert sessions.get(a.token) is a  # use renews it
    clock.now += 90
    assert sessions.get(a.token) is a
    clock.now += 101
    assert sessions.get(a.token) is None
    b = sessions.create(None)
    sessions.drop(b.token)
    assert sessions.get(b.token) is None and sessions.get(None) is None and sessions.get("nope") is None
    few = Sessions(clock=clock, lifetime=100, max_sessions=2)
    first, second = few.create("k1"), few.create("k2")
    clock.now += 1
    assert few.get(second.token) is second  # renewed: first is now the closest to expiry
    few.create("k3")
    assert few.get(first.token) is None and few.get(second.token) is second


def test_failure_limit() -> None:
    clock = Clock()
    limit = FailureLimit(clock=clock, limit=3, window=60)
    for _ in range(3):
        assert limit.retry_after("1.2.3.4") == 0
        limit.failed("1.2.3.4")
    assert limit.retry_after("1.2.3.4") == 60
    assert limit.retry_after("5.6.7.8") == 0  # per address
    clock.now += 30
    assert limit.retry_after("1.2.3.4") == 30
    clock.now += 30
    assert limit.retry_after("1.2.3.4") == 0
    limit.failed("1.2.3.4")
    limit.succeeded("1.2.3.4")
    assert limit.retry_after("1.2.3.4") == 0


def test_safe_next_stays_in_the_console() -> None:
    assert safe_next("/console/?q=a") == "/console/?q=a"
    for bad in (None, "", "https://evil.example/", "//evil.example/console", "/v1/files", "/console\\..\\x"):
        assert safe_next(bad) == "/console/"


def test_windows_money_and_realtime_equivalent() -> None:
    assert window_choices(168) == [1, 2, 6, 12, 24, 48, 72, 96, 120, 144, 168]
    assert window_choices(30) == [1, 2, 6, 12, 24, 30]
    assert window_label(1) == "1 hour" and window_label(48) == "48 hours (2 days)"
    assert money(1_234_567) == "1.2346" and money(0) == "0.0000"
    assert realtime_equivalent(500, 0.5) == 1000 and realtime_equivalent(500, 1.0) == 500


def test_chart_stacks_models_per_day_and_zero_fills() -> None:
    grid = UsageGrid(days=["2026-01-01", "2026-01-02", "2026-01-03"], models=["a", "b"])
    cell = {"requests": 1, "input_tokens": 30, "output_tokens": 10, "cost": 5}
    grid.cells[("2026-01-01", "a")] = cell
    grid.cells[("2026-01-01", "b")] = {**cell, "input_tokens": 0, "output_tokens": 40}
    grid.cells[("2026-01-03", "b")] = {**cell, "input_tokens": 20, "output_tokens": 0}
    drawn = chart(grid, "tokens")
    assert drawn["max"] == "80"
    bars = drawn["bars"]
    assert [b["title"] for b in bars] == ["2026-01-01 a: 40", "2026-01-01 b: 40", "2026-01-03 b: 20"]
    first, second, third = bars
    assert first["h"] == second["h"] == 2 * third["h"]  # scaled to the tallest day
    assert second["y"] + second["h"] == first["y"]  # stacked
    assert grid.value("2026-01-02", "a", "tokens") == 0  # a day without usage is drawn as zero
    assert [t["label"] for t in drawn["ticks"]] == ["01-01", "01-02", "01-03"]


def test_sizes_and_counts_read_as_people_read_them() -> None:
    assert [size(n) for n in (1, 12, 1536, 1_048_576, 209_715_200)] == [
        "1 byte",
        "12 bytes",
        "1.5 KiB",
        "1 MiB",
        "200 MiB",
    ]
    assert count(50_000) == "50,000"


def test_a_keys_page_row_shows_the_effective_scopes_and_where_they_come_from() -> None:
    def record(admin: bool = False, scopes: tuple[str, ...] | None = None) -> KeyRecord:
        return KeyRecord("key_1", "k", "sk-abcdefgh", admin, None, None, None, 100, None, scopes)

    member, chosen, admin = key_row(record()), key_row(record(scopes=("inference",))), key_row(record(admin=True))
    assert (member["scopes"], member["grant"]) == (["inference", "batches", "files"], "default")
    assert (chosen["scopes"], chosen["grant"]) == (["inference"], "chosen")
    assert (admin["scopes"], admin["grant"]) == (["inference", "batches", "files", "models:write", "admin"], "admin")
    assert set(member) == {"id", "name", "prefix", "admin", "scopes", "created_at", "revoked_at", "grant"}
