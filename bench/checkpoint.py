"""Checkpoints of the real model (issue 15), measured: save the resident SmolLM2 weights as a checkpoint, load the
checkpoint, load the catalogue model again; the time of each (seconds, as the HTTP call took), the checkpoint's size
on disk, and whether the reloaded checkpoint scores a prompt with logprobs identical to the saved weights'.

One server on SQLite with the embedded model (float32 on CPU, bfloat16 on a GPU). ``--rounds`` times: save under a
new id, load the catalogue model, load the checkpoint (its top-5 logprobs compared with the ones before the save),
load the catalogue model again and delete the checkpoint. Prints the per-round numbers and their medians, and the
ratio of a checkpoint load to a catalogue load measured in the same run; writes ``bench/results/checkpoint.json``.

Examples::

    .venv/bin/python bench/checkpoint.py               # 3 rounds
    .venv/bin/python bench/checkpoint.py --rounds 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.process import ServerProcess  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "checkpoint.json"
SCORE = {"prompt": "The capital of France is", "max_tokens": 1, "logprobs": 5, "temperature": 0}


def timed(http: httpx.Client, method: str, path: str, **kwargs: Any) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    answer = http.request(method, path, **kwargs)
    seconds = time.perf_counter() - started
    if answer.status_code != 200:
        raise SystemExit(f"{method} {path}: {answer.status_code} {answer.text}")
    return seconds, answer.json()


def top_logprobs(http: httpx.Client, model: str) -> Any:
    answer = http.post("/v1/completions", json={**SCORE, "model": model})
    answer.raise_for_status()
    return answer.json()["choices"][0]["logprobs"]["top_logprobs"]


def one_round(http: httpx.Client, k: int) -> dict[str, Any]:
    before = top_logprobs(http, EMBEDDED_MODEL_ID)
    name = f"bench/smollm2-checkpoint-{k}"
    save_s, saved = timed(http, "POST", "/api/checkpoints", json={"model": name})
    catalogue_s, _ = timed(http, "POST", "/api/models/load", json={"model": EMBEDDED_MODEL_ID})
    load_s, loaded = timed(http, "POST", "/api/models/load", json={"model": name})
    identical = top_logprobs(http, name) == before
    timed(http, "POST", "/api/models/load", json={"model": EMBEDDED_MODEL_ID})
    timed(http, "DELETE", f"/api/checkpoints/{name}")
    return {
        "save_seconds": round(save_s, 3),
        "load_seconds": round(load_s, 3),
        "catalogue_load_seconds": round(catalogue_s, 3),
        "bytes": saved["bytes"],
        "revision_kept": loaded["weights_revision"] == saved["weights_revision"],
        "logprobs_identical": identical,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="miserver-bench-checkpoint-") as tmp,
        ServerProcess(data_dir=Path(tmp) / "var", log_level="warning") as server,
        httpx.Client(base_url=server.base_url, timeout=600.0) as http,
    ):
        resident = next(m for m in http.get("/api/models").json()["data"] if m["resident"])
        rounds = []
        for k in range(args.rounds):
            rounds.append(one_round(http, k))
            print(json.dumps(rounds[-1]))
    keys = ("save_seconds", "load_seconds", "catalogue_load_seconds")
    median = {key: round(statistics.median(r[key] for r in rounds), 3) for key in keys}
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "model": EMBEDDED_MODEL_ID,
        "dtype": resident["dtype"],
        "rounds": rounds,
        "median": median,
        "bytes": rounds[0]["bytes"],
        "load_ratio_checkpoint_to_catalogue": round(median["load_seconds"] / median["catalogue_load_seconds"], 3),
        "all_identical": all(r["logprobs_identical"] and r["revision_kept"] for r in rounds),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
