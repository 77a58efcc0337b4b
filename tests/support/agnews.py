"""Batch rows built from AG News items: the tests read the 200-item sample shipped in ``tests/data/`` (:data:`SAMPLE`),
the benchmarks the full ``ag_news_samples.csv`` of the shared data folder (:func:`ag_news_path`).

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
#: The zero-shot prompt of :func:`agnews_rows` (the latency and resume benchmarks).
SYSTEM = "You label news items by topic. Answer with exactly one of: World, Sports, Business, Sci/Tech. No other words."
#: The few-shot prompt of ``examples/topics.jsonl``, the real-model test and ``bench/batch_vs_direct.py``: a system
#: prompt naming the four labels and four short examples as earlier turns (a 135M model follows a demonstrated answer
#: format far better than an instruction alone).
FEW_SHOT_SYSTEM = (
    "Classify the news by topic. Reply with one word:\n"
    "World: politics, governments, wars, elections, diplomacy, disasters.\n"
    "Sports: games, teams, athletes, matches.\n"
    "Business: companies, markets, prices, jobs, the economy.\n"
    "Sci/Tech: science, research, computers, the internet, space."
)
FEW_SHOTS = (
    (
        "Striker scores twice as club wins the league. The forward's late goals sealed the title on the last day.",
        "Sports",
    ),
    ("Bank shares climb after strong profits. The lender earned more than expected as loan demand rose.", "Business"),
    ("New smartphone chip makes apps run faster. The processor uses less power and speeds up games.", "Sci/Tech"),
    (
        "Rebels attack capital as peace talks stall. The government declared an emergency after fighting spread.",
        "World",
    ),
)
_LABEL_KEYS = (
    ("world", "World"),
    ("sport", "Sports"),
    ("business", "Business"),
    ("sci", "Sci/Tech"),
    ("tech", "Sci/Tech"),
)


def shared_data_dir() -> Path:
    """``$MISERVER_SHARED_DATA`` or ``<repository>/../shared/data``."""
    env = os.environ.get("MISERVER_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def ag_news_path() -> Path:
    """Where ``ag_news_samples.csv`` is read from (it may be missing: callers say what to do then)."""
    return shared_data_dir() / "ag_news_samples.csv"


#: The sample the repository ships: the first 50 items of each label of ``ag_news_samples.csv``, in file order.
SAMPLE = Path(__file__).resolve().parents[1] / "data" / "ag_news_sample.csv"


def balanced_items(per_label: int, path: Path | None = None) -> list[dict[str, str]]:
    """The first ``per_label`` items of each label of ``path`` (default :func:`ag_news_path`), in file order
    (deterministic and balanced); each a CSV row with ``title``, ``description`` and ``label``. Fewer when the file
    has fewer of a label."""
    taken = dict.fromkeys(LABELS, 0)
    items = []
    with (path or ag_news_path()).open(newline="", encoding="utf-8") as fh:
        for item in csv.DictReader(fh):
            if taken[item["label"]] < per_label:
                taken[item["label"]] += 1
                items.append(item)
    return items


def few_shot_messages(text: str) -> list[dict[str, str]]:
    """The few-shot chat messages that ask for the topic of ``text``."""
    messages = [{"role": "system", "content": FEW_SHOT_SYSTEM}]
    for shot, label in FEW_SHOTS:
        messages += [{"role": "user", "content": shot}, {"role": "assistant", "content": label}]
    return [*messages, {"role": "user", "content": text}]


def agnews_rows(
    n: int = 200, *, model: str = EMBEDDED_MODEL_ID, max_tokens: int = 4
) -> list[tuple[str, dict[str, Any], str]]:
    """``n`` label-balanced rows (deterministic: the first n/4 items of each label in file order) as
    ``(custom_id, chat body, gold label)``, interleaved across labels; zero-shot prompt (:data:`SYSTEM`)."""
    per_label = -(-n // len(LABELS))
    by_label: dict[str, list[dict[str, str]]] = {label: [] for label in LABELS}
    for item in balanced_items(per_label):
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


def predicted_label(answer: str) -> str | None:
    """The first of the four labels mentioned in ``answer`` (case-insensitive; 'sci' or 'tech' mean Sci/Tech)."""
    text = answer.lower()
    hits = [(i, label) for key, label in _LABEL_KEYS if (i := text.find(key)) >= 0]
    return min(hits)[1] if hits else None
