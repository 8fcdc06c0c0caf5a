"""Counting datum checks: which datums each check of `engine.datum_checks` saw, and how often."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from posttrain.engine import datum_checks
from posttrain.types import Datum


def rows(datums: Sequence[Datum]) -> Counter[tuple[int, ...]]:
    return Counter(tuple(d.model_input.to_ints()) for d in datums)


@dataclass
class CheckCounts:
    """Datums (by token ids) seen by the compute-free checks (`check_call`: ids, lengths, keys,
    the loss's config and inputs) and by the loss-value checks (`check_loss_values`)."""

    call: Counter[tuple[int, ...]] = field(default_factory=Counter[tuple[int, ...]])
    values: Counter[tuple[int, ...]] = field(default_factory=Counter[tuple[int, ...]])

    def clear(self) -> None:
        self.call.clear()
        self.values.clear()


def count_checks(monkeypatch: pytest.MonkeyPatch) -> CheckCounts:
    """Wrap both checks (which still run) to count the datums each is given."""
    counts = CheckCounts()
    real_call, real_values = datum_checks.check_call, datum_checks.check_loss_values

    def check_call(datums, *args, **kwargs):
        counts.call.update(rows(datums))
        return real_call(datums, *args, **kwargs)

    def check_loss_values(datums, *args, **kwargs):
        # Given the whole call and the rows of each micro-batch: count the rows checked.
        micro_batches = args[2] if len(args) > 2 else kwargs["micro_batches"]
        counts.values.update(rows([datums[r] for rows_ in micro_batches for r in rows_]))
        return real_values(datums, *args, **kwargs)

    monkeypatch.setattr(datum_checks, "check_call", check_call)
    monkeypatch.setattr(datum_checks, "check_loss_values", check_loss_values)
    return counts
