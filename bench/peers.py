"""miServer's resident engine against its peers on the same weights: llama.cpp's ``llama-server`` (the same GGUF
file, ``-np 8``) and ``transformers serve --continuous-batching`` (the same converted weights), each with the same
CPU threads (2), under both OpenMP wait policies (``OMP_WAIT_POLICY`` ACTIVE, spinning, and PASSIVE).

Per engine and policy, in one block on a freshly started server (after two uncounted warm-up chats):

- **alone**: three 32-token greedy chats one after another (their median);
- **8 at once** and **16 at once**: the same chats sent together (wall, and p95 of their latencies);
- **32 rows**: 32 generation rows of 64 tokens (miServer: one ``pack: true`` Batch API job, from its creation to
  ``completed``; a peer, which has no Batch API: the same 32 chat requests sent together), rows/s;
- **single stream**: one streamed 128-token chat, decode tokens/s between the first and the last content chunk.

Every prompt asks for a story, so each chat runs to its ``max_tokens`` (the token counts are printed: a shorter
answer would flatter its engine). The blocks run in ABAB order (``--rounds`` rounds, the engine order reversed
every other round) with the load average before each; the summary gives each engine's median over rounds and
miServer's ratios to llama.cpp's under the same policy. Run it on a quiet machine, alone.

``llama-server`` comes from ``--llama-server``, ``MISERVER_TEST_LLAMA_SERVER`` or ``PATH`` (llama.cpp is never
built here: ``../shared/NOTES.md`` gives the build); a binary that dies with SIGILL was built for another processor
and is reported, not measured.

    .venv/bin/python bench/peers.py
    .venv/bin/python bench/peers.py --engines miserver,llama --policies PASSIVE --rounds 1

Results: ``bench/results/peers.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from miserver.engines.local.loader import embedded_gguf_path  # noqa: E402
from miserver.process import ServerProcess, free_port, wait_for  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID  # noqa: E402
from tests.support.engines import (  # noqa: E402
    ILLEGAL_INSTRUCTION,
    EngineExited,
    EngineProcess,
    embedded_transformers_folder,
    find_llama_server,
)

MODEL = EMBEDDED_MODEL_ID
THREADS = 2
SUBJECTS = [
    "a lighthouse keeper",
    "a lost robot",
    "a dragon who bakes bread",
    "two friends on a train",
    "a cat in Paris",
    "a storm at sea",
    "an old clock",
    "a garden on the moon",
]


def load() -> float:
    return round(os.getloadavg()[0], 2)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def story(i: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    subject = SUBJECTS[i % len(SUBJECTS)]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Write a long story about {subject}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


class Engine:
    """One server under test: ``base_url``, ``model`` (the name its requests use) and ``rows(n, max_tokens)``, which
    runs ``n`` generation rows the engine's own way and returns the seconds they took."""

    def __init__(self, name: str, base_url: str, model: str, rows: Callable[[int, int], float]) -> None:
        self.name, self.base_url, self.model, self.rows = name, base_url, model, rows
        self.http = httpx.Client(base_url=base_url, timeout=600.0)

    def chat(self, i: int, max_tokens: int) -> tuple[float, int]:
        """Seconds and completion tokens of one non-streamed chat."""
        start = time.perf_counter()
        answer = self.http.post("/v1/chat/completions", json={**story(i, max_tokens), "model": self.model})
        answer.raise_for_status()
        return time.perf_counter() - start, int(answer.json()["usage"]["completion_tokens"])

    def together(self, n: int, max_tokens: int) -> tuple[float, list[float], list[int]]:
        """Wall seconds, each chat's seconds and tokens, of ``n`` chats sent at once."""
        start = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            done = list(pool.map(lambda i: self.chat(i, max_tokens), range(n)))
        return time.perf_counter() - start, [d[0] for d in done], [d[1] for d in done]

    def stream_rate(self, max_tokens: int) -> tuple[float, int]:
        """Decode tokens/s of one streamed chat (content chunks after the first, over the time between the first and
        the last) and the number of content chunks."""
        stamps: list[float] = []
        body = {**story(0, max_tokens), "model": self.model, "stream": True}
        with self.http.stream("POST", "/v1/chat/completions", json=body) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    stamps.append(time.perf_counter())
        if len(stamps) < 2:
            return 0.0, len(stamps)
        return (len(stamps) - 1) / (stamps[-1] - stamps[0]), len(stamps)


def measure(engine: Engine) -> dict[str, Any]:
    for i in range(2):
        engine.chat(i, 8)  # warm-up, not counted
    before = load()
    alone = [engine.chat(i, 32) for i in range(3)]
    result: dict[str, Any] = {"load_before": before}
    result["alone_s"] = round(statistics.median(t for t, _ in alone), 3)
    result["alone_tokens"] = [n for _, n in alone]
    for n in (8, 16):
        wall, times, tokens = engine.together(n, 32)
        result[f"at_once_{n}"] = {
            "wall_s": round(wall, 3),
            "p95_s": round(percentile(times, 0.95), 3),
            "x_alone": round(wall / result["alone_s"], 2),
            "tokens_mean": round(statistics.mean(tokens), 1),
        }
    seconds = engine.rows(32, 64)
    result["rows_32"] = {"seconds": round(seconds, 3), "rows_s": round(32 / seconds, 3)}
    rate, chunks = engine.stream_rate(128)
    result["single_stream"] = {"tok_s": round(rate, 2), "chunks": chunks}
    result["load_after"] = load()
    return result


def _policy(policy: str) -> dict[str, str]:
    """The environment of an engine under ``policy``: ``OMP_WAIT_POLICY`` set to it, or (``default``) the engine's
    own choice (miServer's: libgomp's spin count, ``runtime.GOMP_SPINCOUNT``)."""
    return {} if policy == "default" else {"OMP_WAIT_POLICY": policy}


def _peer_rows(engine_ref: list[Engine]) -> Callable[[int, int], float]:
    def rows(n: int, max_tokens: int) -> float:
        wall, _, _ = engine_ref[0].together(n, max_tokens)
        return wall

    return rows


@contextmanager
def miserver(policy: str, tmp: Path) -> Iterator[Engine]:
    env = {"MISERVER_TORCH_THREADS": str(THREADS), **_policy(policy)}
    server = ServerProcess(
        model=MODEL, database_url=f"sqlite:///{tmp}/bench.db", data_dir=tmp / "var", env=env, log_level="warning"
    )
    server.start(timeout=600)
    client = server.client(timeout=600)

    def rows(n: int, max_tokens: int) -> float:
        lines = "".join(
            json.dumps(
                {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": story(i, max_tokens)}
            )
            + "\n"
            for i in range(n)
        )
        uploaded = client.files.create(file=("rows.jsonl", lines.encode()), purpose="batch")
        start = time.perf_counter()
        batch = client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"pack": True},
        )
        done = wait_for(
            lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed", "cancelled") and b,
            timeout=3600,
            interval=0.1,
        )
        assert done.status == "completed" and done.request_counts.completed == n, done
        return time.perf_counter() - start

    try:
        yield Engine("miserver", server.base_url, MODEL, rows)
    finally:
        server.stop()


@contextmanager
def llama(policy: str, tmp: Path, binary: Path) -> Iterator[Engine]:
    port = free_port()
    cmd = [str(binary), "-m", str(embedded_gguf_path()), "--alias", MODEL, "-t", str(THREADS), "-tb", str(THREADS)]
    cmd += ["-np", "8", "-c", "4096", "--flash-attn", "off", "--host", "127.0.0.1", "--port", str(port)]
    process = EngineProcess("llama-server", cmd, tmp / "llama.log", cwd=tmp, env=_policy(policy), port=port)
    process.start(timeout=300)
    ref: list[Engine] = []
    ref.append(Engine("llama", process.base_url, MODEL, _peer_rows(ref)))
    try:
        yield ref[0]
    finally:
        process.stop()


@contextmanager
def transformers_cb(policy: str, tmp: Path) -> Iterator[Engine]:
    link = tmp / "smollm2"
    if not link.exists():
        link.symlink_to(embedded_transformers_folder(), target_is_directory=True)
    port = free_port()
    launcher = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"
    cmd = [sys.executable, "-c", launcher, "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    cmd += ["--continuous-batching", "smollm2"]
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf-home"),
        "OMP_NUM_THREADS": str(THREADS),
        **_policy(policy),
    }
    process = EngineProcess("transformers serve", cmd, tmp / "transformers.log", cwd=tmp, env=env, port=port)
    process.start(timeout=600)
    ref: list[Engine] = []
    ref.append(Engine("transformers-cb", process.base_url, "smollm2", _peer_rows(ref)))
    try:
        yield ref[0]
    finally:
        process.stop()


def start(name: str, policy: str, tmp: Path, binary: Path | None) -> AbstractContextManager[Engine]:
    """The engine ``name`` under ``policy``, its files in ``tmp`` (started on entering)."""
    if name == "miserver":
        return miserver(policy, tmp)
    if name == "llama":
        assert binary is not None
        return llama(policy, tmp, binary)
    return transformers_cb(policy, tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="miserver,llama,transformers-cb")
    parser.add_argument("--policies", default="default,ACTIVE,PASSIVE", help="OpenMP wait policies; default: unset")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, default=None, help="the llama-server binary")
    args = parser.parse_args()
    engines = args.engines.split(",")
    policies = args.policies.split(",")
    binary, why = (args.llama_server.resolve(), "") if args.llama_server else find_llama_server()
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "threads": THREADS,
        "skipped": {},
        "blocks": [],
    }
    if "llama" in engines and binary is None:
        report["skipped"]["llama"] = why
        engines.remove("llama")
    order = [(e, p) for e in engines for p in policies]
    for r in range(args.rounds):
        for name, policy in order if r % 2 == 0 else list(reversed(order)):
            if name in report["skipped"]:
                continue
            with tempfile.TemporaryDirectory() as folder:
                tmp = Path(folder)
                try:
                    started = start(name, policy, tmp, binary)
                    with started as engine:
                        result = measure(engine)
                except EngineExited as exc:
                    if exc.returncode != ILLEGAL_INSTRUCTION:
                        raise
                    report["skipped"][name] = f"{binary} dies with SIGILL: built for another processor"
                    print(f"{name}: {report['skipped'][name]}", flush=True)
                    continue
            block = {"round": r + 1, "engine": name, "policy": policy, **result}
            report["blocks"].append(block)
            print(json.dumps(block), flush=True)
    report["summary"] = summarise(report["blocks"])
    print(json.dumps(report["summary"], indent=2))
    out = ROOT / "bench" / "results" / "peers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {out}; skipped: {report['skipped'] or 'none'}")


METRICS: dict[str, Callable[[dict[str, Any]], float]] = {
    "alone_s": lambda b: float(b["alone_s"]),
    "at_once_8_wall_s": lambda b: float(b["at_once_8"]["wall_s"]),
    "at_once_8_p95_s": lambda b: float(b["at_once_8"]["p95_s"]),
    "at_once_16_wall_s": lambda b: float(b["at_once_16"]["wall_s"]),
    "at_once_16_p95_s": lambda b: float(b["at_once_16"]["p95_s"]),
    "rows_32_rows_s": lambda b: float(b["rows_32"]["rows_s"]),
    "single_stream_tok_s": lambda b: float(b["single_stream"]["tok_s"]),
}


def summarise(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each engine and policy's median per metric over rounds, and per round miServer's value over llama.cpp's under
    the same policy (times: below 1 is miServer faster; rates: above 1 is miServer faster)."""
    summary: dict[str, Any] = {}
    keys = sorted({(b["engine"], b["policy"]) for b in blocks})
    for engine, policy in keys:
        mine = [b for b in blocks if (b["engine"], b["policy"]) == (engine, policy)]
        summary[f"{engine}/{policy}"] = {m: round(statistics.median(f(b) for b in mine), 3) for m, f in METRICS.items()}
    for policy in sorted({p for _, p in keys}):
        ours = {b["round"]: b for b in blocks if b["engine"] == "miserver" and b["policy"] == policy}
        theirs = {b["round"]: b for b in blocks if b["engine"] == "llama" and b["policy"] == policy}
        rounds = sorted(set(ours) & set(theirs))
        if rounds:
            summary[f"miserver_over_llama/{policy}"] = {
                m: [round(f(ours[r]) / f(theirs[r]), 3) for r in rounds] for m, f in METRICS.items() if m != "x_alone"
            }
    return summary


if __name__ == "__main__":
    main()
