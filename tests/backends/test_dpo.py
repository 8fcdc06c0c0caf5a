"""backend.train_dpo: the registered DPO loss on datums, invariance to how an update's pairs are
cut into forward_backward calls and micro-batches, a short run that learns the preferences,
the same losses on every backend (Tinker against a real `posttrain serve`), and bad input.

Tolerances: gradients as in tests/clients/test_local_invariance.py (2e-6 relative: fp32
summation order only; a lost or doubled pair is off by ~1e-1). Backends against LocalBackend as
in test_tinker_custom_loss.py (1e-5 relative on losses: the server's fp32 logprobs, summed in
another order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from backend_kinds import MakeBackend, tiny

from posttrain.backends.local import LocalBackend
from posttrain.clients.create import create_training_client
from posttrain.clients.custom_loss import custom_gradients, custom_loss, is_custom_loss
from posttrain.clients.local import LocalTrainingClient
from posttrain.data.preferences import PreferencePair
from posttrain.engine.executor import InProcessExecutor
from posttrain.rollouts.dpo_data import preference_pair_from_chat
from posttrain.tokenizer import render_chat
from posttrain.trainer.dpo import dpo_loss_fn, loss_name, pair_datums, update_datums
from posttrain.types import AdamParams, Datum

PROMPT = (104, 101, 108, 108, 111, 32)  # "hello "


def make_pairs(count: int, seed: int = 0) -> list[PreferencePair]:
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for i in range(count):
        chosen = torch.randint(97, 123, (3 + i % 3,), generator=gen).tolist()
        rejected = torch.randint(97, 123, (2 + (i + 1) % 4,), generator=gen).tolist()
        pairs.append(PreferencePair((*PROMPT, i + 48), tuple(chosen), tuple(rejected)))
    return pairs


def test_the_registered_loss_on_datums_by_hand():
    # One pair, targets after a 2-token prompt: chosen 2 completion tokens, rejected 2.
    # Same numbers as tests/algo/test_dpo_math.py's sigmoid case: logratio 1, beta 0.5, loss
    # 0.474077, ∂/∂lp = -0.188770 on chosen tokens, +0.188770 on rejected, 0 on the prompt's.
    # pair_weight 0.5 (two pairs in the update) halves both.
    pair = PreferencePair((1, 2), (3, 4), (5, 6))
    chosen, rejected = pair_datums(pair)
    assert chosen.loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 1.0]
    refs = [(torch.tensor([-9.0, -1.5, -2.0]), torch.tensor([-9.0, -2.0, -1.5]))]
    data = update_datums([(chosen, rejected)], refs, beta=0.5, pair_weight=0.5)
    logprobs = [torch.tensor([-5.0, -1.0, -2.0]), torch.tensor([-5.0, -1.0, -3.0])]
    assert is_custom_loss(loss_name("sigmoid")) and is_custom_loss(loss_name("ipo"))
    out = custom_gradients(data, custom_loss(loss_name("sigmoid")), logprobs)
    assert out.loss_sum == pytest.approx(0.5 * 0.474077, abs=1e-6)
    grads = [(-d.loss_fn_inputs["weights"]).tolist() for d in out.data]
    assert grads[0] == pytest.approx([0.0, -0.094385, -0.094385], abs=1e-6)
    assert grads[1] == pytest.approx([0.0, 0.094385, 0.094385], abs=1e-6)
    assert out.metrics["rewards/margin"] == pytest.approx(0.5, rel=1e-6)


def test_the_loss_refuses_datums_it_was_not_made_for():
    plain = list(pair_datums(PreferencePair((1, 2), (3,), (4,))))  # no reference logprobs
    with pytest.raises(ValueError, match="chosen, rejected"):
        dpo_loss_fn("sigmoid")(plain, [torch.zeros(2), torch.zeros(2)])
    with pytest.raises(ValueError, match="chosen, rejected"):
        dpo_loss_fn("ipo")(plain[:1], [torch.zeros(2)])  # half a pair


@pytest.fixture(scope="module")
def clients(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("dpo-inv")
    made = {
        "whole": create_training_client(
            tiny_model_dir, lora_rank=4, seed=1, storage_dir=base / "a"
        ),
        "micro": create_training_client(
            tiny_model_dir, lora_rank=4, seed=1, storage_dir=base / "b", micro_batch_tokens=16
        ),
    }
    # LoRA's B starts at zero, where A gets no gradient: one update first makes both move.
    for client in made.values():
        client.forward_backward_custom(_update(client, make_pairs(2, seed=9), 1.0), _fn()).result()
        client.optim_step(AdamParams(learning_rate=1e-2)).result()
    yield made
    for client in made.values():
        client.close()


def grads_of(client: LocalTrainingClient) -> dict[str, torch.Tensor]:
    executor = client.dispatch.executor
    assert isinstance(executor, InProcessExecutor)
    executor.reduce_gradients()
    return {n: g.clone() for n, g in executor.workers[0].grads().items() if g is not None}


def zero_grads(client: LocalTrainingClient) -> None:
    executor = client.dispatch.executor
    assert isinstance(executor, InProcessExecutor)
    executor.workers[0].zero_grad()


def rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a)
    return (num / sum(float(a[k].double().norm() ** 2) for k in a)) ** 0.5


def _fn():
    return custom_loss(loss_name("sigmoid"))


def _update(client: LocalTrainingClient, pairs: list[PreferencePair], weight: float) -> list[Datum]:
    datums = [pair_datums(p) for p in pairs]
    flat = [d for pair in datums for d in pair]
    ref = client.reference_logprobs(flat).result()
    refs = [(torch.tensor(c), torch.tensor(r)) for c, r in zip(ref[::2], ref[1::2], strict=True)]
    return update_datums(datums, refs, beta=0.1, pair_weight=weight)


def test_gradient_is_the_same_for_one_or_two_calls_and_any_micro_batch(clients):
    pairs = make_pairs(6)
    client = clients["whole"]
    whole = _update(client, pairs, 1 / 6)
    loss = client.forward_backward_custom(whole, _fn()).result().metrics["loss:sum"]
    want = grads_of(client)
    zero_grads(client)
    # Two forward_backward calls of 4 and 2 pairs, each pair whole, on a 16-token micro-batch.
    micro = clients["micro"]
    first = micro.forward_backward_custom(_update(micro, pairs[:4], 1 / 6), _fn()).result()
    second = micro.forward_backward_custom(_update(micro, pairs[4:], 1 / 6), _fn()).result()
    got = grads_of(micro)
    zero_grads(micro)
    assert first.metrics["loss:sum"] + second.metrics["loss:sum"] == pytest.approx(loss, rel=1e-6)
    assert rel_error(want, got) < 2e-6


async def _margins(backend: LocalBackend, model, pairs: list[PreferencePair]) -> torch.Tensor:
    """β-free margins (log π − log π_ref)_chosen − (...)_rejected of each pair, reference base."""
    client = backend.client(model)
    flat = [d for p in pairs for d in pair_datums(p)]
    policy = (await client.forward(flat, "cross_entropy")).loss_fn_outputs
    ref = await client.reference_logprobs(flat)
    deltas = [
        float(((o["logprobs"] - torch.tensor(r)) * d.loss_fn_inputs["weights"]).sum())
        for o, r, d in zip(policy, ref, flat, strict=True)
    ]
    return torch.tensor(deltas[::2]) - torch.tensor(deltas[1::2])


async def test_a_short_run_learns_the_preferences(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path)
    model = tiny("dpo", tiny_model_dir)
    await model.register(backend)
    pairs = make_pairs(8)
    before = await _margins(backend, model, pairs)
    assert before.abs().max() < 1e-6  # LoRA starts as the base model: the reference
    first = await backend.train_dpo(
        model, pairs, beta=0.1, learning_rate=1e-2, batch_size=4, epochs=3
    )
    after = await _margins(backend, model, pairs)
    second = await backend.train_dpo(model, pairs, beta=0.1, learning_rate=1e-2, batch_size=4)
    await backend.close()
    assert first.step == 1 and second.step == 2 and first.checkpoint_path
    assert first.metrics["num_updates"] == 6 and first.metrics["num_pairs"] == 8
    # From all ties to (nearly) every pair preferring its chosen completion, by a wide margin
    # (measured: 7 of 8 pairs, mean margin 3.3 nats).
    assert (after > 0).float().mean() >= 0.75 and after.mean() > 1.0, after
    assert second.metrics["rewards/accuracy"] >= 0.75
    assert second.metrics["rewards/margin"] > first.metrics["rewards/margin"] > 0
    assert second.metrics["loss"] < first.metrics["loss"] < 0.6932  # log 2 at the start


async def test_every_backend_gives_local_backends_losses(
    kind: str, make_backend: MakeBackend, tiny_model_dir, tmp_path
):
    """reference='initial' everywhere (TinkerBackend's only reference), IPO and sigmoid."""
    losses = {}
    for name, make in (("local", LocalBackend), (kind, make_backend)):
        backend = make(tmp_path / name)
        model = tiny("dpo", tiny_model_dir, seed=3)
        await model.register(backend)
        options: dict[str, Any] = {}
        if not (kind == "tinker" and name == kind):
            options["reference"] = "initial"
        runs = []
        for loss in ("sigmoid", "ipo", "sigmoid"):
            result = await backend.train_dpo(  # pyright: ignore[reportAttributeAccessIssue]
                model,
                make_pairs(4),
                loss=loss,
                learning_rate=1e-2,
                batch_size=2,
                save_checkpoint=False,
                **options,
            )
            runs += [result.metrics[k] for k in ("loss", "rewards/margin")]
        losses[name] = runs
        await backend.close()
    assert losses[kind] == pytest.approx(losses["local"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize(
    ("pairs", "error", "match"),
    [
        ([], ValueError, "no preference pairs"),
        (
            [PreferencePair((1,), (2,), (3,)), PreferencePair((1,), (), (3,))],
            ValueError,
            "pair 1 has an empty chosen",
        ),
        ([PreferencePair((1,), (2,), ())], ValueError, "pair 0 has an empty rejected"),
        ([PreferencePair((), (2,), (3,))], ValueError, "pair 0 has an empty prompt"),
        ([PreferencePair((1,), (2, 3), (2, 3))], ValueError, "pair 0 has identical chosen"),
        ([((1,), (2,), (3,))], TypeError, "item 0 is a tuple, not a PreferencePair"),
    ],
)
async def test_bad_pairs_fail_before_any_update(tiny_model_dir, tmp_path, pairs, error, match):
    backend = LocalBackend(tmp_path)
    model = tiny("dpo", tiny_model_dir)
    await model.register(backend)
    with pytest.raises(error, match=match):
        await backend.train_dpo(model, pairs)
    assert model.step == 0
    await backend.close()


async def test_unknown_and_wrong_options_are_errors_before_anything(tmp_path):
    backend = LocalBackend(tmp_path)
    model = tiny("m", tmp_path / "missing")  # never registered
    with pytest.raises(TypeError, match=r"LocalBackend.train_dpo\(\).*'bta'.*did you mean 'beta'"):
        await backend.train_dpo(model, [], bta=0.1)  # pyright: ignore[reportCallIssue]
    with pytest.raises(ValueError, match=r"option beta="):
        await backend.train_dpo(model, [], beta=0.0)
    with pytest.raises(ValueError, match=r"option loss="):
        await backend.train_dpo(model, [], loss="hinge")  # pyright: ignore[reportArgumentType]
    pytest.importorskip("tinker")
    from posttrain.backends.tinker import TinkerBackend

    remote = TinkerBackend(tmp_path / "t", base_url="http://127.0.0.1:9", api_key="tml-x")
    with pytest.raises(TypeError, match=r"TinkerBackend.train_dpo\(\).*'reference'"):
        await remote.train_dpo(model, [], reference="base")  # pyright: ignore[reportCallIssue]


def test_pairs_from_chat_are_the_templates_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = [{"role": "user", "content": "say hi"}]
    pair = preference_pair_from_chat(tokenizer, prompt, "hi", "no")
    assert list(pair.prompt) == render_chat(tokenizer, prompt, True)
    whole = render_chat(tokenizer, [*prompt, {"role": "assistant", "content": "hi"}], False)
    assert list(pair.prompt + pair.chosen) == whole[: len(pair.prompt) + len(pair.chosen)]
    assert pair.chosen[-1] == tokenizer.eos_token_id  # through the end-of-turn token
    with pytest.raises(ValueError, match="identical"):
        preference_pair_from_chat(tokenizer, prompt, "hi", "hi")
    with pytest.raises(ValueError, match="rejected answer must be a non-empty string"):
        preference_pair_from_chat(tokenizer, prompt, "hi", "")
    with pytest.raises(ValueError, match="at least one prompt message"):
        preference_pair_from_chat(tokenizer, [], "hi", "no")


def test_train_dpo_options_are_declared_and_checked_per_backend():
    from posttrain.backends.plugins.registry import describe
    from posttrain.backends.preflight import PreflightError, preflight_dpo
    from posttrain.trainer.config import DPOConfig, from_options

    local, tinker = describe("local"), describe("tinker")
    assert "reference" in {o.name for o in local.train_dpo_options}
    assert "reference" not in {o.name for o in tinker.train_dpo_options}
    initial = from_options(DPOConfig, {"reference": "initial", "beta": 0.2})
    preflight_dpo("LocalBackend", initial, options=local.train_dpo_options)
    with pytest.raises(
        PreflightError, match=r"reference: TinkerBackend.train_dpo\(\) does not take this option"
    ):
        preflight_dpo("TinkerBackend", initial, options=tinker.train_dpo_options)
