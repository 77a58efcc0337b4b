"""The quantized product kernel (``engines/local/quantized.c``) against oneDNN's float32 products over prepacked
weights (the decode step's layout on a CPU without native bfloat16), on the shapes of one SmolLM2-135M decode step.

One step's products: 30 distinct layers of the fused query-key-value (960 x 576), output (576 x 576), fused
gate-up (3072 x 576) and down (576 x 1536) matrices, random weights quantized as GGUF's Q4_1, and the 49152 x 576
output head as Q8_0 (the embedded model's own formats). Per row count, the two run one step's products in turn, the
order reversed every other repetition (ABBA), on torch's threads; the median milliseconds of each and their ratio are
printed with the load average. The agreement of the two is printed too (the quantized products round their inputs
to 8 bits a group).

    .venv/bin/python bench/quantized_products.py
    .venv/bin/python bench/quantized_products.py --rows 1,4,16 --repeats 8

Results: ``bench/results/quantized_products.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # the server's default (runtime.py)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from miserver.engines.local import quantized  # noqa: E402
from miserver.engines.local.llama_ops import project  # noqa: E402
from miserver.engines.local.slot_weights import Int4Matrix, Int8Matrix, Matrix, int4_groups, int8_groups  # noqa: E402
from tests.support.gguf_blocks import q4_1, q8_0  # noqa: E402

LAYERS = 30
#: (out, in) of one layer's products, then the head's
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def step(matrices: list[tuple[Matrix, int]], inputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """One step's products, each ``(matrix, its input width)`` over the input of that width."""
    return [project(inputs[width], m, None) for m, width in matrices]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,24,32")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    kernel = quantized.load()
    if kernel is None:
        sys.exit("the quantized product kernel did not build here (see the log)")
    torch.manual_seed(0)
    own: list[tuple[Matrix, int]] = []
    packed: list[tuple[Matrix, int]] = []
    for shapes, quantize in ((LAYER_SHAPES * LAYERS, q4_1), ([HEAD], q8_0)):
        for out, width in shapes:
            w = quantize(torch.randn(out, width) * 0.05)
            four, eight = int4_groups(w), int8_groups(w)
            if four is not None:
                own.append((Int4Matrix(quantized.int4_tiles(*four), kernel), width))
            elif eight is not None:
                own.append((Int8Matrix(quantized.int8_tiles(*eight), kernel), width))
            packed.append((torch.ops.mkldnn._reorder_linear_weight(w), width))
    results = []
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            inputs = {width: torch.randn(rows, width) for width in (576, 1536)}
            a, b = step(own, inputs), step(packed, inputs)
            worst = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
            times: dict[str, list[float]] = {"quantized": [], "float32": []}
            before = os.getloadavg()[0]
            for r in range(args.repeats):
                pairs = [("quantized", own), ("float32", packed)]
                for name, matrices in pairs if r % 2 == 0 else pairs[::-1]:
                    start = time.perf_counter()
                    step(matrices, inputs)
                    times[name].append((time.perf_counter() - start) * 1000)
            q, f = statistics.median(times["quantized"]), statistics.median(times["float32"])
            line = {
                "rows": rows,
                "quantized_ms": round(q, 2),
                "float32_ms": round(f, 2),
                "ratio": round(q / f, 2),
                "largest_difference": round(worst, 5),
                "load": round(before, 2),
            }
            results.append(line)
            print(json.dumps(line), flush=True)
    target = ROOT / "bench" / "results" / "quantized_products.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    info = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "threads": torch.get_num_threads()}
    target.write_text(json.dumps({"info": info, "results": results}, indent=2))
    print(f"written to {target}")


if __name__ == "__main__":
    main()
