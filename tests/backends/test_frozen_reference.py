"""The KL and DPO reference of a fully fine-tuned policy: a frozen base model in a client of its
own (workers placed and sharded like the policy's), not a copy inside each policy worker.

It must give what the in-worker copy gave: the same base weights and the same pass, so the
steps' metrics and the trained weights are equal bit for bit.
"""

from __future__ import annotations

import torch

from local_groups import synthetic_groups
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.data.preferences import PreferencePair

KL = {"learning_rate": 1e-3, "kl_penalty_coef": 0.5, "loss": "ppo"}


def full_model(tiny_model_dir) -> TrainableModel:
    return TrainableModel(name="full", project="p", base_model=str(tiny_model_dir), lora_rank=None)


def policy_worker(backend: LocalBackend, model: TrainableModel):
    return backend.client(model).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]


async def two_kl_steps(backend: LocalBackend, model: TrainableModel) -> list[dict[str, float]]:
    return [  # pyright: ignore[reportReturnType]
        (await backend.train(model, synthetic_groups(s), **KL)).metrics for s in range(2)
    ]


async def test_full_fine_tuning_scores_kl_with_a_frozen_reference_client(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path / "group")
    model = full_model(tiny_model_dir)
    await model.register(backend)
    got = await two_kl_steps(backend, model)
    assert got[1]["kl"] > 0  # the policy moved away from the reference
    records = backend._models._records.values()
    references = [id(r.model) for r in records if r.reference is not None]
    assert references == [id(model)]
    assert policy_worker(backend, model)._reference is None  # no copy inside the policy's worker

    # The same run scoring with the in-worker copy (the path before reference clients).
    old = LocalBackend(tmp_path / "copy")
    old._models.references = None
    other = full_model(tiny_model_dir)
    await other.register(old)
    expected = await two_kl_steps(old, other)
    assert policy_worker(old, other)._reference is not None
    assert got == expected
    a, b = policy_worker(backend, model), policy_worker(old, other)
    assert all(
        torch.equal(p, q)
        for p, q in zip(
            a.trainable_parameters().values(), b.trainable_parameters().values(), strict=True
        )
    )
    await backend.close()
    await old.close()


async def test_dpo_base_reference_of_a_full_model_is_the_frozen_client(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path)
    model = full_model(tiny_model_dir)
    await model.register(backend)
    pairs = [PreferencePair((5, 6, 7), (8, 9), (10, 11)), PreferencePair((5, 6), (12,), (13,))]
    first = await backend.train_dpo(model, pairs, learning_rate=1e-2, batch_size=2)
    second = await backend.train_dpo(model, pairs, learning_rate=1e-2, batch_size=2)
    # Before any update the policy is the reference: implicit rewards 0. After a step they are
    # not, so the reference stayed the base model rather than following the policy.
    assert first.metrics["rewards/margin"] == 0.0
    assert second.metrics["rewards/margin"] > 0.0
    assert policy_worker(backend, model)._reference is None
    await backend.close()
