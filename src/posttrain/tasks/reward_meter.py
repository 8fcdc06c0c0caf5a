"""Per-step accounting of rewards that cost something (a judge's requests): counts and time
spans, gathered for one RL step and written to its metrics row.

`reward_step()` opens a step: every reward awaited inside it (in tasks it starts, too: a
context variable carries the meter) adds to that step's `RewardMeter`. The job opens one per
RL step; Python code calling `gather_groups` may open one per step the same way, and a judge's
per-step budget then counts within it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass
class RewardMeter:
    """One step's counts (`add`) and time spans (`span`: first start to last end, per name)."""

    counts: dict[str, float] = field(default_factory=dict[str, float])
    spans: dict[str, tuple[float, float]] = field(default_factory=dict[str, tuple[float, float]])

    def add(self, name: str, value: float = 1.0) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + value

    def count(self, name: str) -> float:
        return self.counts.get(name, 0.0)

    def began(self, name: str) -> float:
        """When the span `name` began (perf_counter), starting it now if it has not."""
        if name not in self.spans:
            now = time.perf_counter()
            self.spans[name] = (now, now)
        return self.spans[name][0]

    def ended(self, name: str) -> None:
        """Extend the span `name` to now."""
        start = self.began(name)
        self.spans[name] = (start, time.perf_counter())

    def metrics(self) -> dict[str, float]:
        """The counts, and each span's seconds as `<name>_s`."""
        return {**self.counts, **{f"{k}_s": end - start for k, (start, end) in self.spans.items()}}


_METER: ContextVar[RewardMeter | None] = ContextVar("posttrain_reward_meter", default=None)


@contextmanager
def reward_step() -> Iterator[RewardMeter]:
    """A fresh meter for the rewards awaited inside the block (one RL step's)."""
    meter = RewardMeter()
    token = _METER.set(meter)
    try:
        yield meter
    finally:
        _METER.reset(token)


def current_meter() -> RewardMeter | None:
    """The meter of the step being rewarded, or None outside `reward_step()`."""
    return _METER.get()
