"""engine.placement's `Parking` on its own: a holder of plain torch tensors, no worker."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posttrain.engine.placement import Parking


class Holder:
    """A model, its AdamW and a frozen copy: what a worker lends its Parking."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(3, 2)
        self.reference = nn.Linear(3, 2)
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.device = torch.device("cpu")

    def weight_modules(self) -> list[nn.Module]:
        return [self.model, self.reference]

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())


def grads_of(holder: Holder) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in holder.trainable_parameters().items()}


def test_parked_gradients_come_back_and_a_repeated_move_changes_nothing():
    holder = Holder()
    parking = Parking(holder)
    holder.model(torch.ones(4, 3)).sum().backward()
    before = {n: g.clone() for n, g in grads_of(holder).items() if g is not None}
    # Twice, as after a move that failed on another worker: the second finds no gradients on
    # the parameters and must not park that nothing over the parked ones.
    parking.move(["optimizer", "grads"], [])
    parking.move(["grads"], [])
    assert parking.offloaded == {"optimizer", "grads"}
    assert all(g is None for g in grads_of(holder).values())
    parking.move([], ["grads", "grads"])
    after = {n: g for n, g in grads_of(holder).items() if g is not None}
    assert before.keys() == after.keys() == {"weight", "bias"}
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_parked_state_is_refused_and_gradients_need_their_weights():
    holder = Holder()
    parking = Parking(holder)
    holder.model(torch.ones(1, 3)).sum().backward()
    parking.move(["grads", "weights"], [])
    with pytest.raises(RuntimeError, match=r"\['weights'\] are offloaded"):
        parking.require("optimizer", "weights")
    # Gradients go where their parameters are: not before the weights are back.
    with pytest.raises(RuntimeError, match="weights"):
        parking.reload("grads")
    assert parking.offloaded == {"grads", "weights"}
    # Gradients zeroed while parked stay zeroed: the reload attaches none.
    parking.drop_grads()
    parking.move([], ["weights", "grads"])
    assert not parking.offloaded
    assert all(g is None for g in grads_of(holder).values())
