"""Validation speed and server memory on a 50,000-line, ~200 MB batch file (issue 3's measurement).

1. Speed, in one process: plain ``json.loads`` of every line against miServer's line validation
   (``batches.validate.check_line``: JSON, line shape, the endpoint's strict schema, model resolution). Goal: <= 3x.
2. Memory: a real ``miserver serve`` (tiny random model, SQLite); its RSS at idle, then its peak RSS (VmHWM) while
   the file is uploaded and validated. Goal: under 256 MB above idle.

Usage: ``.venv/bin/python bench/validation.py [--lines 50000] [--line-bytes 4000]``; writes
``bench/results/validation.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.batches.validate import check_line  # noqa: E402
from miserver.engines.base import EngineInfo  # noqa: E402
from miserver.process import ServerProcess, wait_for  # noqa: E402
from miserver.scheduling.admission import AdmissionGate  # noqa: E402
from miserver.services.inference.context import ServiceContext  # noqa: E402
from tests.support.tiny_model import build_tiny_model  # noqa: E402

MODEL = "tiny"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "markets", "rally", "and"]
WORDS += ["teams", "score", "late", "goals"]


def make_file(path: Path, lines: int, line_bytes: int) -> int:
    """Write ``lines`` chat lines of about ``line_bytes`` bytes each; returns the file size."""
    filler = " ".join(WORDS[i % len(WORDS)] for i in range(line_bytes // 5))[: line_bytes - 220]
    with path.open("w") as fh:
        for i in range(lines):
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": "Label the topic: World, Sports, Business or Sci/Tech."},
                    {"role": "user", "content": f"{i} {filler}"},
                ],
                "max_tokens": 4,
                "temperature": 0,
            }
            row = {"custom_id": f"row-{i:06d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            fh.write(json.dumps(row))
            fh.write("\n")
    return path.stat().st_size


def speed(path: Path) -> dict[str, float]:
    raw_lines = path.read_bytes().splitlines()
    t0 = time.perf_counter()
    for raw in raw_lines:
        json.loads(raw)
    parse = time.perf_counter() - t0
    engine = SimpleNamespace(info=EngineInfo(MODEL, "serial", "float32", "sha256:0", 8192))
    ctx = ServiceContext(engine=engine, gate=AdmissionGate(1))  # type: ignore[arg-type]
    seen: set[str] = set()
    t0 = time.perf_counter()
    for raw in raw_lines:
        _, _, _, err = check_line(ctx, "/v1/chat/completions", raw, seen)
        assert err is None, err
    validate = time.perf_counter() - t0
    return {"json_loads_s": parse, "validation_s": validate, "ratio": validate / parse}


def rss_kib(pid: int, field: str) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith(field + ":"):
            return int(row.split()[1])
    raise KeyError(field)


def memory(path: Path, work: Path) -> dict[str, float]:
    model_dir = build_tiny_model(work / "tiny")
    server = ServerProcess(
        model=str(model_dir),
        served_model_name=MODEL,
        database_url=f"sqlite:///{work / 'bench.db'}",
        data_dir=work / "var",
    ).start()
    try:
        assert server.proc is not None
        pid = server.proc.pid
        client = server.http()
        client.get("/v1/models")
        idle = rss_kib(pid, "VmRSS")
        t0 = time.perf_counter()
        with path.open("rb") as fh:
            r = httpx.post(
                server.base_url + "/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", fh)}, timeout=600
            )
        r.raise_for_status()
        upload_s = time.perf_counter() - t0
        batch = client.post(
            "/v1/batches",
            json={"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        ).json()
        t0 = time.perf_counter()
        wait_for(
            lambda: client.get(f"/v1/batches/{batch['id']}").json()["status"] != "validating",
            timeout=1800,
            interval=0.5,
        )
        validate_s = time.perf_counter() - t0
        status = client.get(f"/v1/batches/{batch['id']}").json()
        client.post(f"/v1/batches/{batch['id']}/cancel")
        peak = rss_kib(pid, "VmHWM")
        return {
            "idle_rss_mb": idle / 1024,
            "peak_rss_mb": peak / 1024,
            "peak_above_idle_mb": (peak - idle) / 1024,
            "upload_s": upload_s,
            "server_validation_s": validate_s,
            "status_after_validation": status["status"],
            "rows": status["request_counts"]["total"],
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--line-bytes", type=int, default=4_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = work / "big.jsonl"
        size = make_file(path, args.lines, args.line_bytes)
        print(f"file: {args.lines} lines, {size / 1e6:.1f} MB")
        s = speed(path)
        print(
            f"json.loads {s['json_loads_s']:.2f} s, validation {s['validation_s']:.2f} s, "
            f"ratio {s['ratio']:.2f}x (goal <= 3x)"
        )
        m = memory(path, work)
        print(
            f"server RSS idle {m['idle_rss_mb']:.0f} MB, peak {m['peak_rss_mb']:.0f} MB, "
            f"{m['peak_above_idle_mb']:.0f} MB above idle (goal < 256 MB); upload {m['upload_s']:.1f} s, "
            f"validation in the server {m['server_validation_s']:.1f} s "
            f"({m['rows']} rows, {m['status_after_validation']})"
        )
    out = ROOT / "bench" / "results" / "validation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.date.today().isoformat(), "lines": args.lines, "bytes": size, **s, **m}
    out.write_text(json.dumps(report, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
