"""The decode attention kernel (``engines/local/attention.c``) of this checkout against the one of another git
revision: the same shapes, their bits compared, their times interleaved.

Both sources are built with the flags the engine uses (``native.FLAGS``) into a temporary folder. Per shape
(rows, each row's columns, SmolLM2-135M's 9 query and 3 key-value heads of 64, a bfloat16 cache, 30 layers), the two
kernels run one decode step's attention (30 calls) in turn, the order reversed every other repetition (ABBA); the
median milliseconds per step of each and their ratio are printed with the load average. Every output of the two is
compared bit for bit first: a change of speed must not change a single bit.

    .venv/bin/python bench/attention_kernel.py --against 90c4fc9

Results: ``bench/results/attention_kernel.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # the server's default (runtime.py)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from miserver.engines.local import attention, native  # noqa: E402

SOURCE = "src/miserver/engines/local/attention.c"
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
#: (rows, first row's columns): row r attends to first + 7 r columns
SHAPES = [(1, 60), (16, 60), (16, 250), (48, 150)]


def build(source: Path, target: Path) -> attention.DecodeAttention:
    subprocess.run(["cc", *native.FLAGS, "-o", str(target), str(source)], check=True, capture_output=True)
    return attention.DecodeAttention(ctypes.CDLL(str(target)))


def step(
    kernel: attention.DecodeAttention,
    q: torch.Tensor,
    cache: tuple[list[torch.Tensor], list[torch.Tensor]],
    slot: torch.Tensor,
    seen: torch.Tensor,
) -> list[torch.Tensor]:
    """One decode step's attention: every layer's, in order."""
    keys, values = cache
    return [kernel(q, keys[i], values[i], slot, seen, HEAD_DIM**-0.5) for i in range(LAYERS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the git revision whose kernel is the baseline")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base_source = Path(tmp) / "base.c"
        base_source.write_bytes(
            subprocess.run(
                ["git", "show", f"{args.against}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True
            ).stdout
        )
        kernels = {"base": build(base_source, Path(tmp) / "base.so"), "new": build(ROOT / SOURCE, Path(tmp) / "new.so")}
    generator = torch.Generator().manual_seed(0)
    slots = max(rows for rows, _ in SHAPES)
    capacity = max(first + 7 * (rows - 1) for rows, first in SHAPES)
    keys = [
        torch.randn(slots, KV_HEADS, capacity, HEAD_DIM, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)
    ]
    values = [
        torch.randn(slots, KV_HEADS, capacity, HEAD_DIM, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)
    ]
    lines: list[dict[str, object]] = []
    report: dict[str, object] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "against": args.against,
        "threads": torch.get_num_threads(),
        "shapes": lines,
    }
    for rows, first in SHAPES:
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=generator)
        slot = torch.arange(rows)
        seen = torch.tensor([first + 7 * r for r in range(rows)])
        shape = (q, (keys, values), slot, seen)

        same = all(
            torch.equal(a, b) for a, b in zip(step(kernels["base"], *shape), step(kernels["new"], *shape), strict=True)
        )
        times: dict[str, list[float]] = {"base": [], "new": []}
        load = os.getloadavg()[0]
        for r in range(args.repeats):
            for name in ("base", "new") if r % 2 else ("new", "base"):
                start = time.perf_counter()
                step(kernels[name], *shape)
                times[name].append((time.perf_counter() - start) * 1000)
        base, new = statistics.median(times["base"]), statistics.median(times["new"])
        line = {
            "rows": rows,
            "columns": [first, first + 7 * (rows - 1)],
            "base_ms": round(base, 2),
            "new_ms": round(new, 2),
            "ratio": round(new / base, 3),
            "same_bits": same,
            "load": round(load, 2),
        }
        lines.append(line)
        print(
            f"{rows} rows, columns {first}..{first + 7 * (rows - 1)}: {args.against} {base:.2f} ms, this checkout "
            f"{new:.2f} ms a step (x{new / base:.2f}); same bits: {same}; load {load:.2f}"
        )
    out = ROOT / "bench" / "results" / "attention_kernel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
