"""What exact resume needs besides weights: optimizer state keyed by name, and RNG states.

Optimizer state is stored by parameter name, not by index, so it loads into an optimizer built
over the same parameters in any order or grouping. RNG state covers python `random`, numpy's
global generator, torch CPU and, where present, every CUDA device. Both are plain dicts of
tensors and python scalars, which `torch.load(weights_only=True)` reads back.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

from posttrain.data.checks import expect

OPTIMIZER_STATE_VERSION = 1


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_state_by_name(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, object]:
    """`optimizer.state_dict()` with the model's parameter names in place of indices."""
    names = _param_names(model)
    raw = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    groups: list[dict[str, object]] = []
    for group, raw_group in zip(optimizer.param_groups, raw["param_groups"], strict=True):
        for param, index in zip(group["params"], raw_group["params"], strict=True):
            if id(param) not in names:
                raise ValueError("optimizer holds a parameter that is not in the model")
            index_to_name[index] = names[id(param)]
        groups.append({**raw_group, "params": [index_to_name[i] for i in raw_group["params"]]})
    state = {index_to_name[i]: s for i, s in raw["state"].items()}
    return {"version": OPTIMIZER_STATE_VERSION, "state": state, "param_groups": groups}


def optimizer_state_by_index(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, object], *, source: Path
) -> dict[str, object]:
    """Map a by-name state onto `optimizer`'s own order, for `optimizer.load_state_dict`.

    Each of the optimizer's groups must hold exactly the parameters of one saved group; the
    saved group's hyperparameters (lr, betas, ...) come along with it.
    """
    names = _param_names(model)
    saved_groups = expect(saved["param_groups"], list, f"param_groups in {source}")
    saved_state = expect(saved["state"], dict, f"state in {source}")
    by_members = {frozenset(g["params"]): g for g in saved_groups}
    ours = [
        [names.get(id(p), f"<unnamed {id(p)}>") for p in g["params"]]
        for g in optimizer.param_groups
    ]
    if len(saved_groups) != len(ours) or any(frozenset(m) not in by_members for m in ours):
        saved_names: set[str] = set().union(*by_members)
        our_names = {n for members in ours for n in members}
        raise ValueError(
            f"optimizer state in {source} does not match the optimizer's parameter groups "
            f"({len(saved_groups)} saved, {len(ours)} now); "
            f"only in checkpoint: {sorted(saved_names - our_names)[:5]}, "
            f"only in optimizer: {sorted(our_names - saved_names)[:5]}"
        )
    groups: list[dict[str, object]] = []
    state: dict[int, object] = {}
    start = 0
    for members in ours:
        indices = list(range(start, start + len(members)))
        state |= {
            i: saved_state[n] for i, n in zip(indices, members, strict=True) if n in saved_state
        }
        groups.append({**by_members[frozenset(members)], "params": indices})
        start += len(members)
    return {"state": state, "param_groups": groups}


def rng_state() -> dict[str, object]:
    """The global python, numpy, torch CPU and CUDA generator states."""
    np_state = np.random.get_state(legacy=False)
    # weights_only loading refuses numpy arrays, so the MT19937 key travels as a tensor.
    key = torch.from_numpy(np_state["state"]["key"].astype(np.int64))
    state: dict[str, object] = {
        "python": random.getstate(),
        "numpy": {**np_state, "state": {"key": key, "pos": np_state["state"]["pos"]}},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, object]) -> None:
    """Restore what `rng_state` captured (CUDA states only for devices that exist now)."""
    random.setstate(expect(state["python"], tuple, "the python RNG state"))
    np_state = expect(state["numpy"], dict, "the numpy RNG state")
    inner = expect(np_state["state"], dict, "the numpy RNG state's state")
    key = expect(inner["key"], torch.Tensor, "the numpy RNG key").numpy().astype(np.uint32)
    np.random.set_state({**np_state, "state": {"key": key, "pos": inner["pos"]}})
    torch.set_rng_state(expect(state["torch"], torch.Tensor, "the torch RNG state"))
    if "cuda" in state and torch.cuda.is_available():
        cuda = expect(state["cuda"], list, "the CUDA RNG states")
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
