"""Token-varying advantages (gtpo_sepa, planning tokens found with the tiny model's tokenizer)
give the same gradient whatever the micro-batch size or data-parallel split, in process and on
Ray; and they matter: one mean advantage per sequence gives a clearly different gradient.

Tolerance as in tests/clients/test_local_invariance.py: relative L2 error of the gradients below
2e-6 (fp32 summation order; measured below 5e-7), a cut that lost or doubled tokens would be
off by 1e-1 or more.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.algo.sepa import SEPAState
from posttrain.clients.create import create_training_client
from posttrain.clients.ray import RayTrainingClient
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.trainer.config import RLConfig, from_options
from posttrain.trainer.rl import prepare_batch, weighted
from posttrain.trainer.token_advantages import SEPA_STATE_KEY
from posttrain.types import Datum

REL_TOL = 2e-6
TEXTS = (
    " so let me check the sum",
    " the sum is four",
    " wait let me think again",
    " it is ten, notice that",
    " two plus two",
    " let me verify: yes",
)
OPTIONS = {
    "algorithm_mode": "maxrl_gtpo_sepa",
    "sepa_steps": 10,
    "sepa_delay_steps": 0,
    "gtpo_beta": 0.5,
}


def groups(tokenizer) -> list[TrajectoryGroup]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for g in range(2):
        trajectories = []
        for i, text in enumerate(TEXTS[3 * g : 3 * g + 3]):
            tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
            logprobs = tuple((-torch.rand(len(tokens), generator=gen) * 3).tolist())
            prompt = TokenSegment(tuple(tokenizer.encode(" q:", add_special_tokens=False)))
            reward = float(i == g)  # one correct completion per group
            trajectories.append(Trajectory((prompt, TokenSegment(tokens, True, logprobs)), reward))
        out.append(TrajectoryGroup(tuple(trajectories)))
    return out


def datums_for(client) -> tuple[list[Datum], RLConfig]:
    config = from_options(RLConfig, OPTIONS)
    run_state = {SEPA_STATE_KEY: SEPAState(steps=5, gate_open=True).state_dict()}  # lambda 0.5
    batch = prepare_batch(
        groups(client.get_tokenizer()), config, run_state=run_state, tokenizer=client.get_tokenizer
    )
    assert batch.metrics["sepa_lambda"] == 0.5
    assert 0 < batch.metrics["plan_token_fraction"] < 1  # the texts hold strategic grams
    for datum, mask in zip(batch.datums, batch.masks, strict=True):
        adv = datum.loss_fn_inputs["advantages"][mask > 0]
        assert float(adv.max() - adv.min()) > 1e-2  # really token-varying
    return weighted(batch.datums, batch.masks, config), config


def grads(client) -> dict[str, torch.Tensor]:
    executor = (
        client.executor if isinstance(client, RayTrainingClient) else client.dispatch.executor
    )
    per_rank = executor.full_tensors("grads")
    # Before optim_step each data-parallel rank holds its shard's gradient: their sum is the
    # batch's.
    summed: dict[str, torch.Tensor] = {}
    for rank in per_rank:
        for name, grad in rank.items():
            if grad is not None:
                summed[name] = summed[name] + grad if name in summed else grad.clone()
    return summed


def rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a)
    return (num / sum(float(b[k].double().norm() ** 2) for k in b)) ** 0.5


def gradient(
    client, datums: list[Datum], config: RLConfig
) -> tuple[dict[str, torch.Tensor], float]:
    """The gradient of one forward_backward call (accumulated gradients zeroed first)."""
    if not isinstance(client, RayTrainingClient):  # each Ray client here makes one call
        for worker in client.dispatch.executor.workers:
            worker.zero_grad()
    out = client.forward_backward(datums, config.loss_fn, config.loss_fn_config).result()
    return grads(client), out.metrics["loss:sum"]


def per_sequence_means(datums: list[Datum]) -> list[Datum]:
    out = []
    for datum in datums:
        inputs = dict(datum.loss_fn_inputs)
        mask = inputs["mask"] > 0
        inputs["advantages"] = torch.where(mask, inputs["advantages"][mask].mean(), 0.0)
        out.append(Datum(datum.model_input, inputs))
    return out


def test_token_varying_advantages_are_invariant_to_micro_batches_and_dp(tiny_model_dir, tmp_path):
    kinds = {"whole": {}, "micro": {"micro_batch_tokens": 24}, "dp2": {"num_workers": 2}}
    clients = {
        name: create_training_client(tiny_model_dir, lora_rank=4, storage_dir=tmp_path / name, **kw)
        for name, kw in kinds.items()
    }
    try:
        datums, config = datums_for(clients["whole"])
        reference, loss = gradient(clients["whole"], datums, config)
        for name in ("micro", "dp2"):
            got, got_loss = gradient(clients[name], datums, config)
            assert rel_error(got, reference) < REL_TOL, name
            assert got_loss == pytest.approx(loss, rel=REL_TOL, abs=1e-6), name
        flat, _ = gradient(clients["micro"], per_sequence_means(datums), config)
        assert rel_error(flat, reference) > 1e-2  # the per-token values reach the gradient
    finally:
        for client in clients.values():
            client.close()


@pytest.mark.slow
def test_token_varying_advantages_match_on_ray_dp2(ray_started, tiny_model_dir, tmp_path):
    from posttrain.engine.ray.executor import RayConfig

    local = create_training_client(tiny_model_dir, lora_rank=4, storage_dir=tmp_path / "l")
    remote = create_training_client(
        tiny_model_dir,
        lora_rank=4,
        storage_dir=tmp_path / "r",
        executor="ray",
        num_workers=2,
        ray_config=RayConfig(collective_timeout_s=30.0, startup_timeout_s=180.0),
    )
    try:
        datums, config = datums_for(local)
        reference, loss = gradient(local, datums, config)
        got, got_loss = gradient(remote, datums, config)
        assert rel_error(got, reference) < REL_TOL
        assert got_loss == pytest.approx(loss, rel=REL_TOL, abs=1e-6)
    finally:
        local.close()
        remote.close()
