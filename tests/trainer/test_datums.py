import math

import pytest
import torch

from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.trainer.config import RLConfig, from_options
from posttrain.trainer.datums import rl_datum, sft_datum
from posttrain.trainer.rl import prepare_batch, split_minibatches, weighted


def multi_turn(reward: float = 1.0) -> Trajectory:
    # prompt [1 2 3] | sampled [4 5] | tool [6 7] | sampled [8 9 10]
    return Trajectory(
        segments=(
            TokenSegment((1, 2, 3)),
            TokenSegment((4, 5), trainable=True, logprobs=(-0.4, -0.5)),
            TokenSegment((6, 7)),
            TokenSegment((8, 9, 10), trainable=True, logprobs=(-0.8, -0.9, -1.0)),
        ),
        reward=reward,
    )


def test_multi_turn_masks_only_sampled_targets():
    datum, mask = rl_datum(multi_turn(), advantage=2.0)
    # tokens 1..10; inputs are 1..9 and targets 2..10 (position i predicts token i+1).
    assert datum.model_input.to_ints() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    # Targets 4,5 and 8,9,10 are sampled.
    assert mask.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert datum.loss_fn_inputs["advantages"].tolist() == [0, 0, 2, 2, 0, 0, 2, 2, 2]
    lps = datum.loss_fn_inputs["logprobs"].tolist()
    assert lps == pytest.approx([0, 0, -0.4, -0.5, 0, 0, -0.8, -0.9, -1.0])


def test_trainable_segment_without_logprobs_is_an_error_unless_allowed():
    traj = Trajectory(
        segments=(TokenSegment((1, 2)), TokenSegment((3,), trainable=True)), reward=0.0
    )
    with pytest.raises(ValueError, match="allow_training_without_logprobs"):
        rl_datum(traj, 1.0)
    datum, _ = rl_datum(traj, 1.0, allow_missing_logprobs=True)
    assert math.isnan(datum.loss_fn_inputs["logprobs"][-1])


def test_sft_datum_weights_are_the_trainable_mask():
    datum, mask = sft_datum(multi_turn())
    assert datum.loss_fn_inputs["weights"].tolist() == mask.tolist()


def test_prepare_batch_drops_zero_variance_groups_and_counts_them():
    same = TrajectoryGroup((multi_turn(1.0), multi_turn(1.0)))
    mixed = TrajectoryGroup((multi_turn(1.0), multi_turn(0.0)))
    batch = prepare_batch([same, mixed], RLConfig())
    assert batch.num_zero_variance_groups == 1 and batch.num_dropped_groups == 1
    assert len(batch.datums) == 2
    # grpo with std scaling: rewards [1, 0] -> mean 0.5, std 0.5 -> A = ±0.5/(0.5+1e-6).
    assert batch.advantages == pytest.approx([0.999998, -0.999998], rel=1e-6)
    kept = prepare_batch([same], from_options(RLConfig, {"zero_variance_groups": "keep"}))
    assert len(kept.datums) == 2 and kept.advantages == [0.0, 0.0]


def test_token_mean_weights_sum_to_one_over_the_minibatch():
    batch = prepare_batch([TrajectoryGroup((multi_turn(1.0), multi_turn(0.0)))], RLConfig())
    datums = weighted(batch.datums, batch.masks, RLConfig())
    total = sum(float(d.loss_fn_inputs["weights"].sum()) for d in datums)
    assert total == pytest.approx(1.0)  # 10 trainable tokens, each weighted 1/10
    assert torch.all(datums[0].loss_fn_inputs["weights"][:2] == 0)


def test_split_minibatches():
    assert split_minibatches(7, 3) == [range(0, 2), range(2, 5), range(5, 7)]
    assert split_minibatches(2, 5) == [range(0, 1), range(1, 2)]


def test_empty_groups_is_an_error():
    with pytest.raises(ValueError, match="empty list of trajectory groups"):
        prepare_batch([], RLConfig())
