"""Worker.optim_step: non-finite gradients skip the update; clipping matches a hand-clipped
plain torch AdamW step. Worker.forward_backward: all or nothing; offloaded state is refused."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from posttrain.algo.losses import LossConfig
from posttrain.engine import datum_checks
from posttrain.engine import worker as worker_module
from posttrain.engine.worker import Worker, WorkerConfig
from posttrain.models.load import load_hf_model
from posttrain.types import AdamParams, Datum, ModelInput

CE = LossConfig()


def datums(seed: int, count: int = 3, length: int = 9) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, 250, (length + 1,), generator=gen)
        weights = torch.rand(length, generator=gen)
        out.append(
            Datum(
                ModelInput.from_ints(ids[:-1].tolist()),
                {"target_tokens": ids[1:], "weights": weights},
            )
        )
    return out


@pytest.fixture
def worker(tiny_model_dir: Path) -> Worker:
    # Full fine-tuning, three micro-batches per call of three 9-token datums.
    return Worker(load_hf_model(tiny_model_dir), WorkerConfig(micro_batch_tokens=9))


def weights(worker: Worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.trainable_parameters().items()}


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_gradient_skips_the_update(worker: Worker, bad: float) -> None:
    worker.forward_backward(datums(0), "cross_entropy", CE)
    grads = {n: g.clone() for n, g in worker.grads().items() if g is not None}
    name = next(iter(grads))
    grads[name].view(-1)[3] = bad
    worker.set_grads(grads)
    before = weights(worker)
    metrics = worker.optim_step(AdamParams(learning_rate=1e-2, grad_clip_norm=1.0))
    assert metrics["skipped:sum"] == 1.0
    assert math.isnan(metrics["grad_norm:mean"])
    after = weights(worker)
    assert all(torch.equal(before[n], after[n]) for n in before)  # no update at all
    assert all(g is None for g in worker.grads().values())  # the bad gradients are gone
    assert not worker.optimizer.state  # AdamW never counted the step (no moments, no t)
    # The next finite step is a normal one.
    worker.forward_backward(datums(1), "cross_entropy", CE)
    metrics = worker.optim_step(AdamParams(learning_rate=1e-2))
    assert metrics["skipped:sum"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in worker.trainable_parameters().items())


def test_clipping_reports_the_norm_before_and_steps_on_clipped_grads(worker: Worker) -> None:
    """Two steps against a plain (for-loop) torch AdamW on a copy, clipped by hand.

    AdamW's first update is ~lr * sign(g) whatever g's scale, so clipping only shows from the
    second step on (m and v then mix gradients of different scales): step 1 runs unclipped and
    step 2 clipped, and the test also checks that an unclipped step 2 would land elsewhere.
    """
    adam = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    reference = copy.deepcopy(worker.model)
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    plain = torch.optim.AdamW(ref_params, **adam, foreach=False)
    unclipped_model = copy.deepcopy(worker.model)
    unclipped_params = [p for p in unclipped_model.parameters() if p.requires_grad]
    unclipped = torch.optim.AdamW(unclipped_params, **adam, foreach=False)
    params = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step, seed in enumerate((0, 1)):
        worker.forward_backward(datums(seed), "cross_entropy", CE)
        grads = [g.clone() for g in worker.grads().values() if g is not None]
        assert len(grads) == len(ref_params)
        # ||g|| over all parameters, in float64 from the definition.
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        max_norm = 1e6 if step == 0 else norm / 4  # step 2 clips to a quarter of the norm
        metrics = worker.optim_step(dataclasses.replace(params, grad_clip_norm=max_norm))
        # Reported before clipping; float32 sums of ~1e5 squares: ~1e-6 relative.
        assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
        assert metrics["skipped:sum"] == 0.0
        # torch's clip_grad_norm_: g * min(1, max_norm / (norm + 1e-6)).
        coef = min(1.0, max_norm / (norm + 1e-6))
        for p, q, g in zip(ref_params, unclipped_params, grads, strict=True):
            p.grad = g * coef
            q.grad = g.clone()
        plain.step()
        unclipped.step()
    ours = list(worker.trainable_parameters().values())
    # foreach vs for-loop AdamW: the same elementwise formula, a few float32 ulps apart at most
    # (measured: 7.5e-9 = 1 ulp at 0.1); a wrong clip coefficient moves weights by ~1e-3.
    for a, b in zip(ours, ref_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # Without the clip the second update lands elsewhere (measured 6e-3 away): the comparison
    # above can fail.
    gap = max(
        float((a - b).detach().abs().max()) for a, b in zip(ours, unclipped_params, strict=True)
    )
    assert gap > 1e-4, gap


def test_a_failed_forward_backward_leaves_gradients_untouched(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker.forward_backward(datums(0), "cross_entropy", CE)
    before = {n: g.clone() for n, g in worker.grads().items() if g is not None}
    before_ids = {n: id(g) for n, g in worker.grads().items()}
    real = worker_module.target_logprobs
    calls = []

    def fail_on_second(*args, **kwargs):
        # A runtime fault (out of memory, say) in the second micro-batch, after the first
        # micro-batch's backward already accumulated into the gradients.
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated device failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_module, "target_logprobs", fail_on_second)
    with pytest.raises(RuntimeError, match="simulated"):
        worker.forward_backward(datums(1), "cross_entropy", CE)
    assert len(calls) == 2
    after = worker.grads()
    assert {n: id(g) for n, g in after.items()} == before_ids  # the very same tensors
    for name, grad in before.items():
        assert torch.equal(after[name], grad), name  # pyright: ignore[reportArgumentType]


def test_offloaded_state_is_refused_until_reloaded(worker: Worker) -> None:
    worker.forward_backward(datums(0), "cross_entropy", CE)
    grads = {n: g.clone() for n, g in worker.grads().items() if g is not None}
    worker.move(["optimizer", "grads"], [])
    assert all(p.grad is None for p in worker.trainable_parameters().values())
    with pytest.raises(RuntimeError, match="grads"):
        worker.forward_backward(datums(1), "cross_entropy", CE)
    with pytest.raises(RuntimeError, match="optimizer"):
        worker.optim_step(AdamParams())
    worker.move(["weights"], [])
    with pytest.raises(RuntimeError, match="weights"):
        worker.forward(datums(1), "cross_entropy", CE)
    worker.move([], ["weights", "grads", "optimizer"])
    assert all(torch.equal(g, worker.grads()[n]) for n, g in grads.items())  # pyright: ignore[reportArgumentType]
    assert worker.optim_step(AdamParams())["skipped:sum"] == 0.0


def same_step_as_a_twin(worker: Worker, twin: Worker) -> None:
    """One optim_step on each; the weights must then be bit-identical (same code, same data)."""
    adam = AdamParams(learning_rate=1e-2)
    assert worker.optim_step(adam)["skipped:sum"] == 0.0
    assert twin.optim_step(adam)["skipped:sum"] == 0.0
    mine, theirs = weights(worker), weights(twin)
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)


def test_a_refused_load_keeps_the_gradients(
    worker: Worker, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A load refused before it changes anything leaves the accumulated gradients too: the
    next step equals that of a worker that never saw the load. A successful load drops them."""
    twin = Worker(load_hf_model(tiny_model_dir), WorkerConfig(micro_batch_tokens=9))
    for each in (worker, twin):
        each.forward_backward(datums(0), "cross_entropy", CE)
    weights_only = worker.save_weights(tmp_path / "weights")
    with pytest.raises(FileNotFoundError):
        worker.load_state(tmp_path / "nope")
    with pytest.raises(ValueError, match="no optimizer state"):
        worker.load_state(weights_only, with_optimizer=True)
    same_step_as_a_twin(worker, twin)
    worker.forward_backward(datums(1), "cross_entropy", CE)
    worker.load_state(weights_only, with_optimizer=False)
    assert all(g is None for g in worker.grads().values())  # they belonged to other weights


def test_offload_and_reload_twice_change_nothing(worker: Worker, tiny_model_dir: Path) -> None:
    twin = Worker(load_hf_model(tiny_model_dir), WorkerConfig(micro_batch_tokens=9))
    for each in (worker, twin):  # AdamW moments to park, then gradients to park
        each.forward_backward(datums(0), "cross_entropy", CE)
        each.optim_step(AdamParams(learning_rate=1e-2))
        each.forward_backward(datums(1), "cross_entropy", CE)
    worker.move(["optimizer", "grads", "weights", "optimizer", "grads", "weights"], [])
    assert worker.parking.offloaded == {"weights", "grads", "optimizer"}
    worker.move([], ["weights", "grads", "optimizer", "weights", "grads", "optimizer"])
    assert not worker.parking.offloaded
    same_step_as_a_twin(worker, twin)


def policy_datums(nan_logprob_in_last: bool = False) -> list[Datum]:
    """Three importance_sampling datums; optionally a NaN behaviour logprob on a counted token
    of the last one, which the last micro-batch holds (equal lengths keep their order)."""
    out = []
    for i, datum in enumerate(datums(2)):
        logprobs = torch.full((datum.length,), -5.0)
        if nan_logprob_in_last and i == 2:
            logprobs[4] = math.nan
        inputs = {
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "logprobs": logprobs,
            "advantages": torch.linspace(-1.0, 1.0, datum.length),
        }
        out.append(Datum(datum.model_input, inputs))
    return out


def test_the_up_front_check_holds_one_micro_batch_at_a_time(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss's value checks see the micro-batches the pass sees, never the whole call
    padded together (memory bounded by micro_batch_tokens), and still fail before any backward."""
    seen: list[tuple[int, ...]] = []
    real = datum_checks.pad_datums

    def recording(rows, *args, **kwargs):
        batch = real(rows, *args, **kwargs)
        seen.append(tuple(batch.pad_mask_BT.shape))
        return batch

    monkeypatch.setattr(datum_checks, "pad_datums", recording)
    worker.forward_backward(policy_datums(), "importance_sampling", CE)
    assert seen == [(1, 9)] * 3  # budget 9: one 9-token datum per micro-batch
    grads = {n: g.clone() for n, g in worker.grads().items() if g is not None}
    with pytest.raises(ValueError, match=r"'logprobs'.*NaN"):
        worker.forward_backward(policy_datums(True), "importance_sampling", CE)
    after = worker.grads()
    assert all(torch.equal(g, after[n]) for n, g in grads.items())  # pyright: ignore[reportArgumentType]


def count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Wrap `datum_checks.<name>` so each call appends to the returned list (then runs it)."""
    calls: list[int] = []
    real = getattr(datum_checks, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(datum_checks, name, counting)
    return calls


def test_forward_leaves_loss_value_errors_to_its_pass(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """forward changes nothing, so the loss's own error from the pass is enough; the checks
    that need no compute still give their clear errors first."""
    calls = count_calls(monkeypatch, "check_loss_values")
    with pytest.raises(ValueError, match=r"'logprobs'.*NaN"):
        worker.forward(policy_datums(True), "importance_sampling", CE)
    assert not calls  # raised by the real pass
    bad_id = policy_datums()
    bad_id[1] = Datum(ModelInput.from_ints([3] * 8 + [10**6]), dict(bad_id[1].loss_fn_inputs))
    with pytest.raises(ValueError, match="datum 1 model_input has token id 1000000 outside"):
        worker.forward(bad_id, "importance_sampling", CE)
    with pytest.raises(ValueError, match="same keys"):
        worker.forward([*datums(0, count=1), *policy_datums()], "importance_sampling", CE)


def test_checked_skips_the_repeat_and_computes_the_same(
    worker: Worker, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    twin = Worker(load_hf_model(tiny_model_dir), WorkerConfig(micro_batch_tokens=9))
    data = policy_datums()
    twin_out = twin.forward_backward(data, "importance_sampling", CE)
    calls = count_calls(monkeypatch, "check_datums")
    worker.check_datums(data, "importance_sampling", CE)
    out = worker.forward_backward(data, "importance_sampling", CE, commit=True, checked=True)
    assert len(calls) == 1  # check_datums only
    assert out.loss_sum == twin_out.loss_sum
    assert all(torch.equal(a, b) for a, b in zip(out.logprobs, twin_out.logprobs, strict=True))
    same_step_as_a_twin(worker, twin)
    forward = worker.forward(data, "importance_sampling", CE)
    assert forward.num_tokens == twin_out.num_tokens
