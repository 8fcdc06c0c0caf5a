"""What the trainer's step functions (`train_rl_step`, `train_sft`, `train_dpo`) share.

Each checks its input and prepares everything (teacher logprobs, batches, a critic or reference
opened) before it hands its updates to `run`. Alone, `run` runs them as they are. A backend runs
them inside its all-or-nothing step (`backends.client_models`: checkpoint after, reload on
failure), so bad input fails before there is anything to undo.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeAlias, TypeVar

from posttrain.data.trajectories import JSONScalar
from posttrain.trainer.metrics import StepMetrics

T = TypeVar("T")
# What a model keeps in `run_state`: JSON saved with every checkpoint. An RL step reads its
# controller state (SEPA) from it and writes the new state once its updates are done.
RunState: TypeAlias = dict[str, JSONScalar | list[JSONScalar] | dict[str, JSONScalar]]
Updates: TypeAlias = Callable[[], Awaitable[StepMetrics]]
RunUpdates: TypeAlias = Callable[[Updates], Awaitable[StepMetrics]]
# A critic or reference model, opened only once the input passed its checks (a model load).
Opener: TypeAlias = Callable[[], Awaitable[T]]


async def run_now(updates: Updates) -> StepMetrics:
    """Run a step's updates as they are (nothing to checkpoint or undo)."""
    return await updates()
