"""Scale out on PostgreSQL: a server and two workers share a batch; a killed worker's chunk is reclaimed after the
claim TTL and finished by another process, with no duplicate record. SQLite refuses a second process clearly."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

from tests.support.batches import chat_body, jsonl, line, read_lines, submit, wait_terminal
from tests.support.databases import postgres_database
from tests.support.server import ServerProcess, WorkerProcess, wait_for

ROWS = 60


def executions(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_server_and_two_workers_share_a_batch_and_survive_a_worker_kill(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {"BATCH_CHUNK_ROWS": "3", "BATCH_CLAIM_TTL_SECONDS": "3", "BATCH_POLL_SECONDS": "0.2"}
    logs = {name: tmp_path / f"{name}.executions" for name in ("server", "w1", "w2")}
    with postgres_database() as url:
        server = ServerProcess(
            model=str(tiny_model_dir),
            served_model_name="tiny",
            database_url=url,
            data_dir=tmp_path / "server",
            env={**env, "MISERVER_EXECUTION_LOG": str(logs["server"])},
        )
        workers = [
            WorkerProcess(
                model=str(tiny_model_dir),
                served_model_name="tiny",
                database_url=url,
                name=name,
                data_dir=tmp_path / name,
                env={**env, "MISERVER_EXECUTION_LOG": str(logs[name])},
            )
            for name in ("w1", "w2")
        ]
        with server:
            for w in workers:
                w.start()
            try:
                client = server.client()
                data = jsonl(
                    line(f"r{i:03d}", chat_body(f"Row {i}: say something", max_tokens=16)) for i in range(ROWS)
                )
                batch = submit(client, data)
                wait_for(lambda: len(executions(logs["w1"])) >= 3, timeout=120)
                workers[0].stop(sig=9)  # w1 dies holding a claimed chunk
                done = wait_terminal(client, batch.id, timeout=300)
                out = read_lines(client, done.output_file_id)
            finally:
                for w in workers:
                    w.stop()
        assert done.status == "completed"
        assert done.request_counts is not None and done.request_counts.completed == ROWS
        assert [x["custom_id"] for x in out] == [f"r{i:03d}" for i in range(ROWS)]
        runs = {name: executions(p) for name, p in logs.items()}
        assert all(runs[name] for name in ("server", "w2")), {k: len(v) for k, v in runs.items()}
        counts = Counter(d for v in runs.values() for d in v)
        assert len(counts) == ROWS
        # only the row w1 was running when it died may have run twice
        assert sum(c - 1 for c in counts.values()) <= 1, counts.most_common(3)


def test_sqlite_refuses_a_second_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'one.db'}"
    with ServerProcess(model=str(tiny_model_dir), served_model_name="tiny", database_url=url, data_dir=tmp_path / "a"):
        proc = subprocess.run(
            [sys.executable, "-m", "miserver.cli", "worker", "--database-url", url, "--model", str(tiny_model_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode != 0
    assert "in use by another miserver process" in proc.stderr and "PostgreSQL" in proc.stderr
