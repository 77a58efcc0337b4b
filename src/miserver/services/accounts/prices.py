"""Prices: the price table (a JSON file, ``MISERVER_PRICES_FILE``), the cost of tokens, and the usage record of a
batch row at its batch's prices.

Money is integer micro-units of the price table's currency (1 unit = 1,000,000 micro-units). The price table is a
JSON file (``MISERVER_PRICES_FILE``)::

    {"currency": "USD", "batch_discount": 0.5,
     "models": {"my-model": {"input": 150000, "output": 600000}, "*": {"input": 0, "output": 0}}}

``input``/``output`` are micro-units per million tokens at the realtime price; batch rows pay ``batch_discount``
times that (default 0.5: half price). ``"*"`` prices every model not listed; a model with no price costs nothing.
A line's cost is ``round((input_tokens * input + output_tokens * output) / 1e6)``, half up.

A batch's prices are fixed at its creation (:meth:`PriceTable.batch_snapshot`, stored on the batch): a later change
of the table does not re-price it. A row's usage record (:func:`row_usage`) is written by the batch runner in the
transaction that records the row, keyed by batch and line (:mod:`miserver.store.usage`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...clock import now
from ...store.usage import Usage

MICRO = 1_000_000


#: The key a price table uses for "every other model".
ANY_MODEL = "*"


class PriceFileError(ValueError):
    """The price file cannot be read or does not have the documented shape (the message says where)."""


@dataclass(frozen=True)
class PriceTable:
    """Realtime prices per model (micro-units per million tokens: ``(input, output)``), the batch discount (a
    fraction of the realtime price, 0..1) and the currency's name."""

    models: dict[str, tuple[int, int]] = field(default_factory=dict)
    batch_discount: float = 0.5
    currency: str = "USD"

    @classmethod
    def load(cls, path: Path | None) -> PriceTable:
        """The table in ``path`` (None: an empty table, everything free). Raises :class:`PriceFileError`."""
        if path is None:
            return cls()
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PriceFileError(f"price file {path}: {exc}") from None
        return cls.parse(raw, str(path))

    @classmethod
    def parse(cls, raw: Any, where: str = "price table") -> PriceTable:
        """The table of a decoded JSON document. Raises :class:`PriceFileError` naming the bad field."""
        if not isinstance(raw, dict):
            raise PriceFileError(f"{where}: expected a JSON object")
        unknown = set(raw) - {"currency", "batch_discount", "models"}
        if unknown:
            raise PriceFileError(f"{where}: unknown field {sorted(unknown)[0]!r}")
        discount = raw.get("batch_discount", 0.5)
        if isinstance(discount, bool) or not isinstance(discount, int | float) or not 0 <= discount <= 1:
            raise PriceFileError(f"{where}: 'batch_discount' must be a number from 0 to 1")
        currency = raw.get("currency", "USD")
        if not isinstance(currency, str):
            raise PriceFileError(f"{where}: 'currency' must be a string")
        models_raw = raw.get("models", {})
        if not isinstance(models_raw, dict):
            raise PriceFileError(f"{where}: 'models' must be an object of model id -> {{input, output}}")
        models: dict[str, tuple[int, int]] = {}
        for model, price in models_raw.items():
            if not isinstance(price, dict) or set(price) - {"input", "output"}:
                raise PriceFileError(f'{where}: models[{model!r}] must be {{"input": int, "output": int}}')
            values = [price.get("input", 0), price.get("output", 0)]
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
                raise PriceFileError(f"{where}: models[{model!r}] prices must be integers >= 0 (micro-units)")
            models[model] = (values[0], values[1])
        return cls(models=models, batch_discount=float(discount), currency=currency)

    def realtime(self, model: str) -> tuple[int, int]:
        """``(input, output)`` realtime price of ``model`` per million tokens (``"*"``, else free)."""
        return self.models.get(model, self.models.get(ANY_MODEL, (0, 0)))

    def batch(self, model: str) -> tuple[int, int]:
        """``(input, output)`` batch price of ``model``: the realtime price times the discount, rounded."""
        i, o = self.realtime(model)
        return round(i * self.batch_discount), round(o * self.batch_discount)

    def batch_snapshot(self) -> dict[str, list[int]]:
        """Every batch price now, as stored on a batch at its creation (``{model: [input, output]}``)."""
        return {model: list(self.batch(model)) for model in self.models}

    @property
    def enabled(self) -> bool:
        """Whether any price is set (an empty table makes every line free)."""
        return bool(self.models)


def price_from_snapshot(snapshot: dict[str, list[int]] | None, model: str) -> tuple[int, int]:
    """A batch's price for ``model`` from the snapshot taken at its creation (``"*"``, else free)."""
    if not snapshot:
        return 0, 0
    price = snapshot.get(model, snapshot.get(ANY_MODEL, [0, 0]))
    return int(price[0]), int(price[1])


def cost(price: tuple[int, int], input_tokens: int, output_tokens: int) -> int:
    """Micro-units for the tokens at ``price`` (per million), rounded half up."""
    return (input_tokens * price[0] + output_tokens * price[1] + MICRO // 2) // MICRO


def row_usage(
    *,
    owner: str | None,
    prices: dict[str, list[int]] | None,
    endpoint: str,
    batch_id: str,
    line: int,
    model: str,
    input_tokens: int,
    output_tokens: int,
) -> Usage | None:
    """The usage record of a successful batch row at the batch's own prices (None for a batch without an owner)."""
    if owner is None:
        return None
    return Usage(
        key_id=owner,
        model=model,
        kind="batch",
        endpoint=endpoint,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cost=cost(price_from_snapshot(prices, model), input_tokens, output_tokens),
        created_at=now(),
        batch_id=batch_id,
        line=line,
    )
