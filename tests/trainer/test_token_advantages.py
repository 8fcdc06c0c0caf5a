"""Per-token advantages through `prepare_batch`: datums carry them on the exact sampled tokens,
the SEPA controller's state goes in and out through run_state, and bad input is refused."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algo.sepa import SEPAState
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.trainer.config import RLConfig, from_options
from posttrain.trainer.rl import prepare_batch
from posttrain.trainer.token_advantages import SEPA_STATE_KEY

WORDS = {20: " so", 21: " let", 22: " me", 23: " check", 24: " it", 25: " now"}


class WordTokenizer:
    """Decodes token ids 20-25 to words (the trainer only decodes)."""

    all_special_ids: list[int] = []  # noqa: RUF012

    def decode(self, token_ids: list[int], /, *, skip_special_tokens: bool = False) -> str:
        return "".join(WORDS[t] for t in token_ids)

    def encode(self, text: str, /, *, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def apply_chat_template(self, conversation: object, /, **kwargs: object) -> object:
        raise NotImplementedError


def sampled(tokens: tuple[int, ...], logprobs: tuple[float, ...], reward: float) -> Trajectory:
    return Trajectory((TokenSegment((1, 2)), TokenSegment(tokens, True, logprobs)), reward)


def multi_turn(reward: float) -> Trajectory:
    # prompt [1 2 3] | sampled [4 5] | tool [6 7] | sampled [8 9 10]: targets 4,5 and 8,9,10.
    return Trajectory(
        segments=(
            TokenSegment((1, 2, 3)),
            TokenSegment((4, 5), trainable=True, logprobs=(-0.4, -0.5)),
            TokenSegment((6, 7)),
            TokenSegment((8, 9, 10), trainable=True, logprobs=(-0.8, -0.9, -1.0)),
        ),
        reward=reward,
    )


def trained(datum) -> list[float]:
    mask = datum.loss_fn_inputs["mask"] > 0
    return datum.loss_fn_inputs["advantages"][mask].tolist()


# Datum advantages are float32: 1e-6 relative is a few fp32 ulps.
F32 = 1e-6


def test_gtpo_weights_each_sampled_token_of_a_multi_turn_trajectory():
    batch = prepare_batch(
        [TrajectoryGroup((multi_turn(1.0), multi_turn(0.0)))],
        from_options(RLConfig, {"algorithm_mode": "maxrl_gtpo"}),
    )
    # maxrl over [1, 0]: mean 0.5, A = +-0.5 / (0.5 + 1e-6). Surprisal of the 5 sampled targets
    # u = [0.4, 0.5, 0.8, 0.9, 1.0], mean 0.72: w = 1 + 0.1 (u / 0.72 - 1) = 0.9 + 0.1 u / 0.72.
    a = 0.5 / 0.500001
    w = [0.9 + 0.1 * u / (0.72 + 1e-8) for u in (0.4, 0.5, 0.8, 0.9, 1.0)]
    first, second = batch.datums
    assert trained(first) == pytest.approx([a * x for x in w], rel=F32)
    assert trained(second) == pytest.approx([-a * x for x in w], rel=F32)
    # Context targets (prompt, tool output) keep advantage 0.
    assert first.loss_fn_inputs["advantages"][[0, 1, 4, 5]].tolist() == [0, 0, 0, 0]
    assert batch.advantages == pytest.approx([a, -a])  # the episode advantages
    assert set(batch.metrics) >= {"exec_uncertainty_mean", "plan_uncertainty_var"}
    assert batch.metrics["exec_uncertainty_mean"] == pytest.approx(0.72)
    assert batch.run_state == {}  # no controller


def test_reinforce_pp_whitens_every_token_including_real_zeros():
    traj = lambda r: sampled((20, 21), (-0.1, -0.2), r)  # noqa: E731
    groups = [
        TrajectoryGroup((traj(1.0), traj(0.0), traj(0.5))),  # centred: [0.5, -0.5, 0.0]
        TrajectoryGroup((traj(0.0), traj(0.0), traj(1.0))),  # centred: [-1/3, -1/3, 2/3]
    ]
    batch = prepare_batch(groups, from_options(RLConfig, {"algorithm_mode": "reinforce_pp_none"}))
    # Two tokens each: 12 values summing to 0 (mean 0); squares 4 * 0.25 + 2 * 0 + 4 / 9 * 4 ...
    # = 1 + 0 + 4/9 + 8/9 = 21/9, so sigma = sqrt(21/9 / 12) = 0.440959. The real zero (reward
    # 0.5, the group mean) counts: without it sigma would be sqrt(21/9 / 10).
    sigma = math.sqrt(21 / 9 / 12)
    want = [0.5, -0.5, 0.0, -1 / 3, -1 / 3, 2 / 3]
    got = [trained(d) for d in batch.datums]
    assert got == [pytest.approx([x / (sigma + 1e-8)] * 2, rel=F32, abs=1e-7) for x in want]


def test_gtpo_hicra_boosts_planning_tokens_found_in_the_decoded_text():
    # " so let me check it": "let me check" is a default strategic gram -> tokens 21, 22, 23.
    logprobs = (-1.0, -1.0, -1.0, -1.0, -1.0)  # equal surprisal: gtpo weights are all 1
    group = TrajectoryGroup(
        (sampled((20, 21, 22, 23, 24), logprobs, 1.0), sampled((25, 24), (-1.0, -1.0), 0.0))
    )
    config = from_options(RLConfig, {"token_transform": "gtpo_hicra", "hicra_alpha": 0.5})
    batch = prepare_batch([group], config, tokenizer=WordTokenizer)
    # grpo over [1, 0]: A = +-0.5 / (0.5 + 1e-6); planning tokens get A + 0.5 |A|.
    a = 0.5 / 0.500001
    # Targets drop the first prompt token only: all 5 sampled tokens are trained.
    assert trained(batch.datums[0]) == pytest.approx([a, 1.5 * a, 1.5 * a, 1.5 * a, a], rel=F32)
    assert trained(batch.datums[1]) == pytest.approx([-a, -a], rel=F32)
    assert batch.metrics["plan_token_fraction"] == pytest.approx(3 / 7)
    with pytest.raises(ValueError, match="planning tokens in the decoded text"):
        prepare_batch([group], config)  # no tokenizer


def test_gtpo_sepa_reads_and_returns_the_controller_state():
    group = TrajectoryGroup(
        (
            sampled((21, 22, 23, 24, 25), (-0.2, -0.4, -0.6, -2.0, -1.0), 1.0),
            sampled((24, 25, 20), (-0.5, -1.5, -1.0), 0.0),
        )
    )
    options = {
        "algorithm_mode": "maxrl_gtpo_sepa",
        "sepa_steps": 10,
        "sepa_delay_steps": 0,
        "sepa_correct_rate_gate": 0.5,
    }
    config = from_options(RLConfig, options)
    # First step: no saved state, gate closed -> lambda 0 (plain gtpo); the step is 50% correct,
    # which opens the gate for the next step.
    first = prepare_batch([group], config, tokenizer=WordTokenizer)
    assert first.metrics["sepa_lambda"] == 0.0 and first.metrics["sepa_gate_open"] == 0.0
    saved = first.run_state[SEPA_STATE_KEY]
    assert saved == SEPAState(steps=1, gate_open=True).state_dict()
    # Resumed from a state 4 steps in: lambda = 4 / 10. Completion 0's execution tokens are
    # 24, 25 (u = 2.0, 1.0; mean 1.5) -> 0.4 * 1.5 + 0.6 * u = [1.8, 1.2]; planning 21-23 keep
    # [0.2, 0.4, 0.6]. gtpo (beta 0.1) over h = [0.2, 0.4, 0.6, 1.8, 1.2], mean 0.84.
    run_state = {"cursor": 7, SEPA_STATE_KEY: SEPAState(steps=4, gate_open=True).state_dict()}
    batch = prepare_batch([group], config, run_state=run_state, tokenizer=WordTokenizer)
    assert batch.metrics["sepa_lambda"] == pytest.approx(0.4)
    a = 0.5 / 0.500001
    h = [0.2, 0.4, 0.6, 1.8, 1.2]
    want = [a * (0.9 + 0.1 * x / (0.84 + 1e-8)) for x in h]
    assert trained(batch.datums[0]) == pytest.approx(want, rel=F32)
    assert batch.run_state[SEPA_STATE_KEY]["steps"] == 5
    assert run_state[SEPA_STATE_KEY]["steps"] == 4  # the caller's run_state is never written


def test_a_custom_kind_by_dotted_path(monkeypatch):
    batch = prepare_batch(
        [TrajectoryGroup((multi_turn(1.0), multi_turn(0.0)))],
        from_options(
            RLConfig, {"token_transform": "gtpo", "uncertainty_kind": "custom_kinds:squared"}
        ),
    )
    # u = lp^2 = [0.16, 0.25, 0.64, 0.81, 1.0], mean 0.572; grpo A = 0.5 / (0.5 + 1e-6).
    a = 0.5 / 0.500001
    u = [0.16, 0.25, 0.64, 0.81, 1.0]
    want = [a * (0.9 + 0.1 * x / (0.572 + 1e-8)) for x in u]
    assert trained(batch.datums[0]) == pytest.approx(want, rel=F32)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (
            "custom_kinds:short",
            r"uncertainty_kind='custom_kinds:short' returned 4 values for a completion of 5",
        ),
        ("custom_kinds:NOT_A_FUNCTION", "is a int, not a function"),
        ("custom_kinds:missing", "has no attribute 'missing'"),
        ("no_such_module_xyz:kind", "does not import"),
        ("shannon_entropy", r"reads per-token .*: sample it with SamplingParams\(entropies=True\)"),
        ("custom_kinds:entropy_gap", r"sample it with SamplingParams\(entropies=True\)"),
    ],
)
def test_bad_kinds_are_refused_naming_the_kind(kind, message):
    config = from_options(RLConfig, {"token_transform": "gtpo", "uncertainty_kind": kind})
    with pytest.raises(ValueError, match=message):
        prepare_batch([TrajectoryGroup((multi_turn(1.0), multi_turn(0.0)))], config)


def test_a_kind_reading_logprobs_refuses_a_segment_without_them():
    group = TrajectoryGroup(
        (
            Trajectory((TokenSegment((1, 2)), TokenSegment((3, 4), True)), 1.0),
            Trajectory((TokenSegment((1, 2)), TokenSegment((3, 4), True)), 0.0),
        )
    )
    options = {"token_transform": "gtpo", "allow_training_without_logprobs": True}
    with pytest.raises(
        ValueError, match="group 0 trajectory 0: uncertainty_kind='surprisal' reads"
    ):
        prepare_batch([group], from_options(RLConfig, options))
    # Without a transform the logprobs are not read: the step trains at ratio 1 as before.
    none = from_options(RLConfig, {"allow_training_without_logprobs": True})
    assert len(prepare_batch([group], none).datums) == 2


def test_no_transform_keeps_one_advantage_per_sequence():
    batch = prepare_batch([TrajectoryGroup((multi_turn(1.0), multi_turn(0.0)))], RLConfig())
    assert len(set(trained(batch.datums[0]))) == 1
    assert batch.metrics == {} and batch.run_state == {}


def test_entropy_mask_keeps_the_groups_most_uncertain_tokens():
    group = TrajectoryGroup(
        (
            sampled((20, 21, 22), (-1.0, -5.0, -3.0), 1.0),
            sampled((23, 24), (-4.0, -2.0), 0.0),
        )
    )
    options = {"token_transform": "entropy_mask", "entropy_mask_rho": 0.4, "gtpo_beta": 0.0}
    batch = prepare_batch([group], from_options(RLConfig, options))
    # u over the group [1, 5, 3, 4, 2]: top 40% of 5 = 2 tokens, threshold 4.
    a = 0.5 / 0.500001
    assert trained(batch.datums[0]) == pytest.approx([0.0, a, 0.0], rel=F32)
    assert trained(batch.datums[1]) == pytest.approx([-a, 0.0], rel=F32)
    assert batch.metrics["entropy_mask_fraction"] == pytest.approx(3 / 5)


def test_shannon_entropy_reads_the_sampled_tokens_entropies():
    def traj(entropies: tuple[float, ...], reward: float) -> Trajectory:
        sampled = TokenSegment((20, 21, 22), True, (-1.0, -1.0, -1.0), entropies)
        return Trajectory((TokenSegment((1, 2)), sampled), reward)

    group = TrajectoryGroup((traj((0.5, 1.0, 1.5), 1.0), traj((2.0, 2.0, 2.0), 0.0)))
    options = {"token_transform": "gtpo", "uncertainty_kind": "shannon_entropy"}
    batch = prepare_batch([group], from_options(RLConfig, options))
    # Equal logprobs (surprisal would weigh every token 1); entropies [0.5, 1, 1.5], mean 1:
    # w = 1 + 0.1 (h - 1) = [0.95, 1, 1.05]. The second completion's are flat: weights 1.
    a = 0.5 / 0.500001
    assert trained(batch.datums[0]) == pytest.approx([0.95 * a, a, 1.05 * a], rel=F32)
    assert trained(batch.datums[1]) == pytest.approx([-a, -a, -a], rel=F32)
    # One trainable segment without entropies: the kind cannot be computed for that completion.
    bare = Trajectory((TokenSegment((1, 2)), TokenSegment((20, 21), True, (-1.0, -1.0))), 0.0)
    with pytest.raises(ValueError, match="group 0 trajectory 1: uncertainty_kind='shannon_ent"):
        prepare_batch(
            [TrajectoryGroup((traj((0.5, 1.0, 1.5), 1.0), bare))], from_options(RLConfig, options)
        )


def test_token_advantages_reach_the_datums_as_float32_per_target():
    group = TrajectoryGroup((multi_turn(1.0), multi_turn(0.0)))
    batch = prepare_batch([group], from_options(RLConfig, {"token_transform": "gtpo"}))
    adv = batch.datums[0].loss_fn_inputs["advantages"]
    assert adv.dtype == torch.float32 and adv.shape == batch.masks[0].shape
