"""Calls pyright must reject: each line marked `# expect: <option>` is a type error."""

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.protocol import TrainableBackend
from posttrain.backends.ray import RayBackend
from posttrain.backends.tinker import TinkerBackend


async def wrong_calls(backend: LocalBackend, generic: TrainableBackend, model: TrainableModel) -> None:
    await backend.train(model, [], learning_rat=1e-5)  # expect: learning_rat
    await backend.train(model, [], loss="reinforce")  # expect: loss
    await backend.train(model, [], num_minibatches="2")  # expect: num_minibatches
    await backend.train_sft(model, [], kl_penalty_coef=0.1)  # expect: kl_penalty_coef
    await backend.train_sft(model, [], assistant_turns="first")  # expect: assistant_turns
    await backend.train_dpo(model, [], bta=0.1)  # expect: bta
    await backend.train_dpo(model, [], loss="hinge")  # expect: loss
    await generic.train(model, [], kl_penalty_coef=0.1)  # expect: kl_penalty_coef
    await generic.train(model, [], plot_tensors=True)  # expect: plot_tensors
    await generic.train(model, [], mask_prob_ratio=True)  # expect: mask_prob_ratio
    await generic.train(model, [], loss="dro")  # expect: loss
    await generic.train(model, [], advantage_estimator="gae")  # expect: advantage_estimator


async def wrong_ray_calls(backend: RayBackend, model: TrainableModel) -> None:
    await backend.train(model, [], check_weights_in_sync="yes")  # expect: check_weights_in_sync
    await backend.train_sft(model, [], check_weights_in_sync=True)  # expect: check_weights_in_sync


async def right_calls(backend: LocalBackend, generic: TrainableBackend, model: TrainableModel) -> None:
    await backend.train(model, [], learning_rate=1e-5, loss="cispo", kl_penalty_coef=0.1)
    await backend.train_sft(model, [], batch_size=4, assistant_turns="last", packing=True)
    await backend.train_dpo(model, [], beta=0.1, loss="ipo", reference="initial")
    await generic.train(model, [], learning_rate=1e-5, epsilon=0.2)


async def right_ray_calls(backend: RayBackend, model: TrainableModel) -> None:
    generic: TrainableBackend = backend
    await backend.train(model, [], kl_penalty_coef=0.1, check_weights_in_sync=True)
    await backend.train_sft(model, [], batch_size=4, packing=True)
    await backend.train_dpo(model, [], reference="base", batch_size=4)
    await generic.train(model, [], learning_rate=1e-5)


async def wrong_tinker_calls(backend: TinkerBackend, model: TrainableModel) -> None:
    await backend.train(model, [], kl_penalty_coef=0.1)  # expect: kl_penalty_coef
    await backend.train(model, [], loss="gspo")  # expect: loss
    await backend.train(model, [], truncated_importance_sampling=2.0)  # expect: truncated_importance_sampling
    await backend.train(model, [], precalculate_logprobs=True)  # expect: precalculate_logprobs
    await backend.train_sft(model, [], epsilon=0.2)  # expect: epsilon
    await backend.train_sft(model, [], packing=True)  # expect: packing
    await backend.train_dpo(model, [], reference="base")  # expect: reference
    await backend.train(model, [], gae_lambda=0.95)  # expect: gae_lambda
    await backend.train(model, [], critic_learning_rate=1e-5)  # expect: critic_learning_rate
    await backend.train(model, [], advantage_estimator="gae")  # expect: advantage_estimator


async def right_tinker_calls(backend: TinkerBackend, local: LocalBackend, model: TrainableModel) -> None:
    generic: TrainableBackend = backend
    await backend.train(model, [], loss="cispo", epsilon=0.2, epsilon_high=0.28, num_minibatches=2)
    await backend.train_sft(model, [], batch_size=4, lr_schedule="linear")
    await backend.train_dpo(model, [], beta=0.1, loss="sigmoid", epochs=2)
    await generic.train(model, [], learning_rate=1e-5, loss="importance_sampling")
    await backend.train(model, [], advantage_estimator="rloo")
    generic = local
    await generic.train(model, [], loss="ppo")
    await local.train(model, [], advantage_estimator="gae", gae_lambda=0.95, value_clip=None)
    await local.train(model, [], critic_learning_rate=1e-5, update_epochs=2)
