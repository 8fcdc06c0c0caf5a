"""What a Ray executor must know about each call it makes on a rank, declared on the method.

`WorkerHost` marks each method it offers with `rank_call`: whether a worker's own exception in
it leaves every rank as it was (`read_only`: the group stays usable), and whether every rank
must enter it even with nothing of its own to do (`collective`: the ranks agree on the input
first, or FSDP gathers the weights). `RayExecutor` reads these from the typed method it calls,
never from a list of names.

Also here, the outcomes a rank reports so the executor can tell them apart: a failed collective
(`CollectiveError`: the group is out of step), a call every rank refused before changing
anything (`Rejected`: the group carries on), and anything else, the worker's own exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeVar

F = TypeVar("F", bound=Callable[..., object])
# "always": every rank takes part (the ranks agree on the input); "sharded": every rank when the
# model is sharded with FSDP2 (the weights are gathered); "own": only ranks given work.
Collective = Literal["always", "sharded", "own"]


@dataclass(frozen=True)
class CallKind:
    read_only: bool
    collective: Collective = "own"

    def everyone(self, sharded: bool) -> bool:
        """Whether every rank must be called, given work or not."""
        return self.collective == "always" or (self.collective == "sharded" and sharded)


_KINDS: dict[Callable[..., object], CallKind] = {}


def rank_call(*, read_only: bool, collective: Collective = "own") -> Callable[[F], F]:
    """Declare how an executor calls this rank method (see the module docstring)."""

    def mark(method: F) -> F:
        _KINDS[method] = CallKind(read_only, collective)
        return method

    return mark


def kind_of(method: Callable[..., object]) -> CallKind:
    """The declared kind of a rank method (a method without one is a programming error)."""
    try:
        return _KINDS[method]
    except KeyError:
        raise TypeError(f"{method!r} is not a rank call: mark it with @rank_call") from None


class CollectiveError(RuntimeError):
    """A collective failed or timed out on this rank: a peer stalled or died."""


class PeerRefused(RuntimeError):
    """Raised on the other ranks when rank 0 refuses a checkpoint (nothing was changed)."""


@dataclass(frozen=True)
class Rejected:
    """This rank refused the call before changing anything; `error` is None when a peer did."""

    error: BaseException | None


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn any failure inside into a `CollectiveError` naming `what`."""
    try:
        yield
    except Exception as exc:
        raise CollectiveError(
            f"{what} failed ({type(exc).__name__}: {exc}); a collective that times out means "
            "a peer rank stalled or died"
        ) from exc
