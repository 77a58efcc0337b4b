"""The decode step of this checkout against another commit's, both in one process: for changes to the engine room
whose gain is smaller than the machine's swing between processes (a one-row step took 10-19 ms in back-to-back
processes on one machine).

The other commit's ``src/miserver`` is taken with ``git archive`` and imported as the package ``miserver_before``
(every ``miserver`` import and logger name in it renamed). Each side starts a ``LocalEngine`` on the embedded
SmolLM2 and makes the served step cache (``decoding.DEFAULT_DECODE``), every slot holding the same chat prompt;
then, per round and row count, each side runs one uncounted and ``--steps`` timed decode steps on its engine
thread, the order of the two reversed every other round (ABBA). In one process the engine started second can run
slower whichever code it holds, so the whole comparison runs twice, in a fresh process each time, once with each side
started first; the printed ratio is the geometric mean of the two orders' median ratios, with the load average.

    .venv/bin/python bench/step_against.py 92da136
    .venv/bin/python bench/step_against.py HEAD~3 --rows 1,8 --rounds 12

Results: ``bench/results/step_against.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a lighthouse keeper."
OLD = "miserver_before"


def export(rev: str, into: Path) -> None:
    """``rev``'s ``src/miserver`` as the package ``OLD`` under ``into``."""
    data = subprocess.run(["git", "archive", rev, "src/miserver"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    package = into / OLD
    (into / "src" / "miserver").rename(package)
    name = re.compile(r"\bmiserver(?=[. ])")
    for path in package.rglob("*.py"):
        path.write_text(name.sub(OLD, path.read_text()))


def load() -> float:
    return round(os.getloadavg()[0], 2)


async def measure(first: str, rows: list[int], rounds: int, steps: int) -> dict[str, dict[int, list[float]]]:
    """Per side (``before``, ``after``) and row count, the seconds a step of each round; ``first`` starts first."""
    import torch

    sides: dict[str, Any] = {}
    for side in (first, "after" if first == "before" else "before"):
        package = OLD if side == "before" else "miserver"
        decoding = __import__(f"{package}.engines.local.decoding", fromlist=["x"])
        engine_module = __import__(f"{package}.engines.local.engine", fromlist=["x"])
        settings = __import__(f"{package}.settings", fromlist=["x"])
        engine = await engine_module.LocalEngine.start(
            settings.EMBEDDED_MODEL_ID, cache_dir=settings.Settings().cache_dir, device="cpu"
        )
        model, context = engine.loaded.model, engine.context_length
        cache = await engine.call(lambda _, d=decoding, m=model, c=context: d.make_slots(m, c, d.DEFAULT_DECODE))
        ids = torch.tensor(engine.tokenize_chat([{"role": "user", "content": PROMPT}]), dtype=torch.long)

        def prefill(_: object, cache: Any = cache, ids: torch.Tensor = ids) -> int:
            with torch.inference_mode():
                token = int(torch.argmax(cache.prefill(0, ids)))
                for slot in range(1, max(rows)):
                    cache.prefill(slot, ids)
                return token

        sides[side] = (engine, cache, await engine.call(prefill))
    times: dict[str, dict[int, list[float]]] = {side: {n: [] for n in rows} for side in sides}
    for round_ in range(rounds):
        for n in rows:
            order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
            for side in order:
                engine, cache, token = sides[side]

                def run(_: object, cache: Any = cache, token: int = token, n: int = n) -> float:
                    with torch.inference_mode():
                        slots = list(range(n))
                        cache.decode(slots, [token] * n)
                        begun = time.perf_counter()
                        for _ in range(steps):
                            cache.decode(slots, [token] * n)
                        return (time.perf_counter() - begun) / steps

                times[side][n].append(await engine.call(run))
    for engine, _, _ in sides.values():
        await engine.close()
    return times


def child(args: argparse.Namespace) -> None:
    """One order, in this process: prints the times as JSON on the last line."""
    sys.path.insert(0, args.package_dir)
    sys.path.insert(0, str(ROOT / "src"))
    from miserver.runtime import GOMP_SPINCOUNT

    if "OMP_WAIT_POLICY" not in os.environ:  # OpenMP's waiting as the server sets it, before torch starts OpenMP
        os.environ.setdefault("GOMP_SPINCOUNT", str(GOMP_SPINCOUNT))
    rows = [int(r) for r in args.rows.split(",")]
    times = asyncio.run(measure(args.first, rows, args.rounds, args.steps))
    print(json.dumps({side: {str(n): t for n, t in per.items()} for side, per in times.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the commit to compare this checkout's src/miserver against")
    parser.add_argument("--rows", default="1,2,8,16", help="row counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=6, help="decode steps timed per side, round and row count")
    parser.add_argument("--first", choices=["before", "after"], help=argparse.SUPPRESS)
    parser.add_argument("--package-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first:
        child(args)
        return
    rows = [int(r) for r in args.rows.split(",")]
    report: dict[str, Any] = {"rev": args.rev, "load": [load()], "orders": {}}
    with tempfile.TemporaryDirectory() as tmp:
        export(args.rev, Path(tmp))
        for first in ("before", "after"):
            cmd = [sys.executable, __file__, args.rev, "--rows", args.rows, "--rounds", str(args.rounds)]
            cmd += ["--steps", str(args.steps), "--first", first, "--package-dir", tmp]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            times = json.loads(done.stdout.strip().splitlines()[-1])
            report["orders"][first] = {
                n: {side: statistics.median(times[side][str(n)]) * 1000 for side in ("before", "after")} for n in rows
            }
            report["load"].append(load())
    report["rows"] = []
    for n in rows:
        ratios = [report["orders"][f][n]["after"] / report["orders"][f][n]["before"] for f in ("before", "after")]
        mean = math.sqrt(ratios[0] * ratios[1])
        ms = {f: report["orders"][f][n] for f in ("before", "after")}
        report["rows"].append(
            {"rows": n, "after_over_before": round(mean, 3), "by_order": [round(r, 3) for r in ratios]}
        )
        print(
            f"{n:3d} rows: after / before {mean:.3f} (before started first {ratios[0]:.3f}: "
            f"{ms['before']['before']:.2f} -> {ms['before']['after']:.2f} ms; after started first {ratios[1]:.3f}: "
            f"{ms['after']['before']:.2f} -> {ms['after']['after']:.2f} ms)"
        )
    print(f"load {report['load']}")
    out = ROOT / "bench" / "results" / "step_against.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
