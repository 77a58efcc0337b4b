"""Batch rows built from ``../shared/data/ag_news_samples.csv`` (read in place, never copied into the repository).

Each row asks the model for the topic of a news item (World, Sports, Business, Sci/Tech); the gold label comes back
beside the row, never inside the request body (batch lines are strict).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from miserver.settings import EMBEDDED_MODEL_ID

LABELS = ("World", "Sports", "Business", "Sci/Tech")
SYSTEM = (
    "You label news items by topic. Answer with exactly one of: World, Sports, Business, Sci/Tech. "
    "No other words."
)


def shared_data_dir() -> Path:
    """``$MISERVER_SHARED_DATA`` or ``<repository>/../shared/data``."""
    env = os.environ.get("MISERVER_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def agnews_rows(n: int = 200, *, model: str = EMBEDDED_MODEL_ID, max_tokens: int = 4) -> list[tuple[str, dict[str, Any], str]]:
    """``n`` label-balanced rows (deterministic: the first n/4 items of each label in file order) as
    ``(custom_id, chat body, gold label)``, interleaved across labels."""
    per_label = -(-n // len(LABELS))
    by_label: dict[str, list[dict[str, str]]] = {label: [] for label in LABELS}
    with (shared_data_dir() / "ag_news_samples.csv").open(newline="", encoding="utf-8") as fh:
        for item in csv.DictReader(fh):
            if len(by_label[item["label"]]) < per_label:
                by_label[item["label"]].append(item)
    interleaved = [by_label[label][i] for i in range(per_label) for label in LABELS][:n]
    rows = []
    for i, item in enumerate(interleaved):
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{item['title']}. {item['description']}\nTopic:"},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        rows.append((f"ag-{i:04d}", body, item["label"]))
    return rows


def predicted_label(text: str) -> str | None:
    """The first label named in a model's answer (case-insensitive; 'sci' or 'tech' mean Sci/Tech)."""
    lowered = text.lower()
    positions = {label: lowered.find(label.lower()) for label in ("World", "Sports", "Business")}
    for word in ("sci/tech", "science", "tech", "sci"):
        if (p := lowered.find(word)) >= 0:
            positions["Sci/Tech"] = p if "Sci/Tech" not in positions else min(positions["Sci/Tech"], p)
            break
    found = {k: v for k, v in positions.items() if v >= 0}
    return min(found, key=found.__getitem__) if found else None
