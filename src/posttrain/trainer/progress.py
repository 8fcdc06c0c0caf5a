"""Progress of the trainer's long loops, with a rate and an ETA: a tqdm bar on a terminal,
periodic lines otherwise (so a slow run never looks hung).

Where the lines go is set by the caller with `report_progress` (the train job sends them to
its output); without it a terminal gets a bar on stderr and anything else the
`posttrain.progress` logger at INFO. A bar appears only after `BAR_DELAY_S` and a line only
every `interval_s`, so a short loop shows nothing.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

Emit = Callable[[str], None]
BAR_DELAY_S = 2.0
INTERVAL_S = 10.0

log = logging.getLogger("posttrain.progress")


@dataclass(frozen=True)
class ProgressSettings:
    bar: bool  # a tqdm bar on stderr, else lines
    emit: Emit | None = None  # where lines go; None: the `posttrain.progress` logger
    interval_s: float = INTERVAL_S  # at most one line per interval


_settings: ContextVar[ProgressSettings | None] = ContextVar("posttrain_progress", default=None)


@contextmanager
def report_progress(
    emit: Emit | None = None, *, bar: bool | None = None, interval_s: float = INTERVAL_S
) -> Iterator[None]:
    """Within this block (and the tasks it starts), loops report as asked: `bar=None` means a
    bar when stderr is a terminal; lines go to `emit` every `interval_s` seconds at most."""
    as_bar = sys.stderr.isatty() if bar is None else bar
    token = _settings.set(ProgressSettings(as_bar, emit, interval_s))
    try:
        yield
    finally:
        _settings.reset(token)


def duration(seconds: float) -> str:
    """45s, 2m05s, 1h02m; ? when unknown."""
    if not math.isfinite(seconds):
        return "?"
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class Progress:
    """Counts the `total` units (e.g. "update") of one loop named `label`."""

    def __init__(self, label: str, total: int, unit: str) -> None:
        self.settings = _settings.get() or ProgressSettings(bar=sys.stderr.isatty())
        self.label, self.total, self.unit = label, total, unit
        self.done = 0
        self._start = self._last = time.perf_counter()
        self._bar = None
        if self.settings.bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=label, unit=unit, delay=BAR_DELAY_S, leave=False, file=sys.stderr
            )

    def update(self, n: int = 1, **values: float) -> None:
        """`n` more units done; `values` (a loss, say) are shown beside the counts."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            if values:
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=False)
            return
        now = time.perf_counter()
        if now - self._last >= self.settings.interval_s:
            self._last = now
            line = self.line(now - self._start, values)
            (self.settings.emit or log.info)(line)

    def line(self, elapsed: float, values: dict[str, float]) -> str:
        """`label: done/total units (pct)  rate  elapsed  eta  values`."""
        rate = self.done / elapsed if elapsed > 0 else math.inf
        if rate >= 1 or rate == 0:
            speed = f"{rate:.3g} {self.unit}s/s"
        else:
            speed = f"{1 / rate:.3g} s/{self.unit}"
        eta = (self.total - self.done) / rate if rate > 0 else math.inf
        shown = "".join(f"  {k} {v:.4g}" for k, v in values.items())
        return (
            f"{self.label}: {self.done}/{self.total} {self.unit}s "
            f"({100 * self.done / max(self.total, 1):.0f}%)  {speed}  "
            f"elapsed {duration(elapsed)}  eta {duration(eta)}{shown}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
