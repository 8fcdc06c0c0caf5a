"""How a step's updates combine the metrics each forward_backward reports, by their reduction,
and that a custom loss's own metrics reach TrainResult.metrics."""

from __future__ import annotations

import torch

from local_groups import synthetic_groups
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.clients import custom_loss as registry
from posttrain.clients.custom_loss import register_loss
from posttrain.trainer.metrics import StepMetrics
from posttrain.types import Datum


def test_each_reduction_combines_the_updates_its_way():
    """Two updates of 1 and 3 tokens: avg (1·1 + 4·3) / 4 = 3.25 token-weighted; n 2 + 3 = 5;
    peak max(0.5, 0.7) = 0.7; low min(-1, -2) = -2; loss the mean of the two sums, 2.0."""
    metrics = StepMetrics()
    first = {"loss:sum": 1.0, "tokens:sum": 1.0, "avg:mean": 1.0, "n:sum": 2.0}
    metrics.add_update({**first, "peak:max": 0.5, "low:min": -1.0}, {}, num_tokens=1)
    second = {"loss:sum": 3.0, "tokens:sum": 3.0, "avg:mean": 4.0, "n:sum": 3.0}
    metrics.add_update({**second, "peak:max": 0.7, "low:min": -2.0}, {}, num_tokens=3)
    out = metrics.as_dict()
    assert (out["avg"], out["n"], out["peak"], out["low"], out["loss"]) == (3.25, 5, 0.7, -2, 2)
    assert out["num_trainable_tokens"] == 4 and "tokens" not in out  # the same count
    metrics.flow = {"peak": 9.0}  # what the trainer computes itself wins
    assert metrics.as_dict()["peak"] == 9.0
    # A second PPO epoch over the first update's token: its mean weighs by 1 token again, but
    # the step trained no new token: (1·1 + 4·3 + 5·1) / 5 = 3.6, 4 tokens.
    third = {"loss:sum": 1.0, "avg:mean": 5.0}
    metrics.add_update(third, {}, num_tokens=1, new_tokens=False)
    out = metrics.as_dict()
    assert out["avg"] == 3.6 and out["num_trainable_tokens"] == 4 and out["num_updates"] == 3


def _counting_loss(data: list[Datum], logprobs: list[torch.Tensor]):
    """−Σ lp over the trainable tokens, reporting how many datums and tokens it saw."""
    weights = [(d.loss_fn_inputs["weights"] != 0).float() for d in data]
    loss = -torch.cat([w * lp for w, lp in zip(weights, logprobs, strict=True)]).sum()
    return loss, {
        "datums:sum": float(len(data)),
        "longest:max": float(max(int(w.sum()) for w in weights)),
    }


async def test_a_custom_losss_metrics_reach_the_train_result(tiny_model_dir, tmp_path, monkeypatch):
    """synthetic_groups(3): 3 groups of 4, one with all-equal rewards (dropped), so 8
    trajectories in 2 mini-batches: the loss sees each datum once, 8 in all."""
    monkeypatch.setattr(registry, "_registered", {})
    name = register_loss("counting", _counting_loss)
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    groups = synthetic_groups(3)
    result = await backend.train(
        model, groups, loss=name, num_minibatches=2, learning_rate=1e-3, save_checkpoint=False
    )
    assert result.metrics["num_trajectories"] == 8 and result.metrics["num_updates"] == 2
    assert result.metrics["datums"] == 8
    longest = max(len(t.segments[-1].tokens) for g in groups for t in g.trajectories)
    assert result.metrics["longest"] == longest
    await backend.close()


def _unsuffixed(data: list[Datum], logprobs: list[torch.Tensor]):
    return -torch.cat(logprobs).sum(), {"datums": float(len(data))}


async def test_a_metric_without_a_reduction_is_averaged_over_the_updates(
    tiny_model_dir, tmp_path, monkeypatch
):
    """8 trajectories (as above) in 2 mini-batches of 4: 4 datums in each update."""
    monkeypatch.setattr(registry, "_registered", {})
    name = register_loss("unsuffixed", _unsuffixed)
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    result = await backend.train(
        model, synthetic_groups(3), loss=name, num_minibatches=2, save_checkpoint=False
    )
    assert result.metrics["num_updates"] == 2 and result.metrics["datums"] == 4.0
    await backend.close()
