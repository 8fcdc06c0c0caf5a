"""torch's thread settings in this process and what competes for the cores: `posttrain doctor`
and the server's log line."""

from __future__ import annotations

import os
from dataclasses import dataclass

from posttrain.engine.threads import chosen_threads, requested_threads, usable_cores


@dataclass(frozen=True)
class ThreadReport:
    """torch's thread settings in this process, and what competes for the cores."""

    torch_threads: int  # torch's count now (its default unless something configured it)
    chosen: int | None  # what posttrain's commands set; None if the environment is invalid
    usable: int
    requested: int | None
    source: str  # the variable that asked for `requested`, or ""
    load_1min: float | None  # the machine's 1-minute load average, where known
    error: str = ""  # why the environment's request is invalid
    wait_policy: str = ""  # OMP_WAIT_POLICY as torch's OpenMP read it at load ("": default)

    def warnings(self) -> list[str]:
        """What makes compute slow: more threads than cores, or cores already busy."""
        found = [self.error] if self.error else []
        if self.requested is not None and self.requested > self.usable:
            found.append(
                f"{self.source}={self.requested} asks for more threads than the {self.usable} "
                f"usable core(s): OpenMP threads will wait on each other; set "
                f"{self.source}={self.usable} or unset it"
            )
        elif self.torch_threads > self.usable:
            found.append(
                f"torch defaults to {self.torch_threads} threads on {self.usable} usable "
                "core(s): posttrain's commands set the count themselves, but code that calls "
                f"torch directly oversubscribes; set OMP_NUM_THREADS={self.usable}"
            )
        # One thread has no OpenMP barrier to wait at: busy cores only share its time.
        if self.load_1min is not None and self.load_1min > self.usable and self.torch_threads > 1:
            fix = "stop that work, or lower OMP_NUM_THREADS to the cores left free"
            if self.wait_policy.upper() != "PASSIVE":
                # libgomp reads it once, when torch loads: too late to set from Python.
                fix += (
                    ", or start with OMP_WAIT_POLICY=PASSIVE in the environment (waiting "
                    "OpenMP threads then sleep instead of spinning on the busy cores)"
                )
            found.append(
                f"the 1-minute load average is {self.load_1min:.1f} on {self.usable} usable "
                "core(s): other work shares the cores, so OpenMP threads wait on each other "
                f"and compute runs several times slower; {fix}"
            )
        return found

    def describe(self) -> str:
        chosen = "?" if self.chosen is None else str(self.chosen)
        asked = f" ({self.source}={self.requested})" if self.requested is not None else ""
        load = f"; load average {self.load_1min:.1f}" if self.load_1min is not None else ""
        policy = f"OMP_WAIT_POLICY={self.wait_policy}" if self.wait_policy else "default"
        return (
            f"posttrain computes with {chosen} torch thread(s){asked} on {self.usable} usable "
            f"core(s) of {os.cpu_count()}; torch in this process: {self.torch_threads}; "
            f"OpenMP waits: {policy}{load}"
        )


def thread_report(hidden_size: int | None = None) -> ThreadReport:
    """The thread settings of this process, for `posttrain doctor` and server logs (which give
    the `hidden_size` of the model they serve, as to `configure_torch_threads`)."""
    import torch

    try:
        requested, source = requested_threads()
        chosen: int | None = chosen_threads(hidden_size)
        error = ""
    except ValueError as exc:
        requested, source, chosen, error = None, "", None, str(exc)
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip()
    return ThreadReport(
        torch.get_num_threads(), chosen, usable_cores(), requested, source, load, error, policy
    )
