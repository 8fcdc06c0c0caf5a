"""posttrain.blocks: the rollouts handoff's building blocks (seed 004), with the tests it lists
(dtype parsing, device maps, the optimizer, the loss, the one-call client on the CPU, and on a
GPU where there is one) plus hand-derived values for the loss and the schedules, on the tiny
model built locally."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.blocks import (
    JSONLLogger,
    compute_device_map_single_gpu,
    create_adamw_optimizer,
    create_backend_with_scheduler,
    create_cross_entropy_loss,
    create_pytorch_backend,
    create_warmup_cosine_scheduler,
    load_hf_model,
    parse_dtype,
)
from posttrain.clients.protocol import (
    BatchSampler,
    CustomLossClient,
    ExportsWeights,
    TrainingClient,
)
from posttrain.types import AdamParams, Datum, ModelInput

FP32 = 1e-6  # float32 log-softmax of a handful of values: ~1e-7 relative rounding


def test_parse_dtype():
    assert parse_dtype("bfloat16") == torch.bfloat16
    assert parse_dtype("float32") == torch.float32
    with pytest.raises(ValueError, match=r"dtype 'invalid' is not supported; use one of float32"):
        parse_dtype("invalid")


def test_compute_device_map_single_gpu():
    assert compute_device_map_single_gpu("cuda", 4) == {"": 4}
    assert compute_device_map_single_gpu("cpu", 0) is None
    with pytest.raises(ValueError, match=r"device_type must be 'cuda' or 'cpu', got 'tpu'"):
        compute_device_map_single_gpu("tpu", 0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"gpu_rank must be an int >= 0, got -1"):
        compute_device_map_single_gpu("cuda", -1)


def test_load_hf_model_takes_a_device_map(tiny_model_dir):
    model = load_hf_model(tiny_model_dir, "float32", compute_device_map_single_gpu("cpu", 0))
    assert next(model.parameters()).device.type == "cpu" and not model.training
    with pytest.raises(ValueError, match=r"device map \{'a': 0\} is not supported"):
        load_hf_model(tiny_model_dir, "float32", {"a": 0})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device is 'cuda:0', but CUDA is not available"):
            load_hf_model(tiny_model_dir, "float32", {"": 0})


def test_create_adamw_optimizer_from_a_model_or_parameters():
    model = torch.nn.Linear(10, 10)
    optimizer = create_adamw_optimizer(model, lr=1e-4)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == 1e-4
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    model.bias.requires_grad_(False)  # a frozen parameter is not optimized (LoRA's base)
    assert create_adamw_optimizer(model).param_groups[0]["params"] == [model.weight]
    assert create_adamw_optimizer([model.bias]).param_groups[0]["params"] == [model.bias]


def test_cross_entropy_loss_as_the_handoff_calls_it():
    loss_fn = create_cross_entropy_loss()
    logits = torch.randn(2, 10, 100)
    batch = {"labels": torch.randint(0, 100, (2, 10)), "loss_mask": torch.ones(2, 10)}
    assert loss_fn(logits, batch).item() > 0


def _naive_cross_entropy(logits_BTV, labels_BT, mask_BT):
    """The reference: one token at a time, -log softmax(logits)[label], masked mean."""
    total, count = torch.zeros((), dtype=torch.float64), 0.0
    for b in range(labels_BT.shape[0]):
        for t in range(labels_BT.shape[1]):
            if labels_BT[b, t] == -100 or mask_BT[b, t] == 0:
                continue
            logp_V = torch.log_softmax(logits_BTV[b, t].double(), dim=-1)
            total = total - mask_BT[b, t] * logp_V[labels_BT[b, t]]
            count += float(mask_BT[b, t])
    return total / count


def test_cross_entropy_loss_hand_derived_and_against_a_naive_loop():
    # Two-token vocabulary, logits [0, ln 3]: p = [1/4, 3/4]. Label 1 costs ln(4/3) = 0.2876821,
    # label 0 costs ln 4 = 1.3862944; -100 costs nothing and is not counted.
    logits = torch.tensor([[[0.0, math.log(3.0)]] * 3])
    labels = torch.tensor([[1, 0, -100]])
    loss_fn = create_cross_entropy_loss()
    mean = loss_fn(logits, {"labels": labels})
    assert mean.item() == pytest.approx((0.2876821 + 1.3862944) / 2, rel=FP32)  # 0.8369882
    masked = loss_fn(logits, {"labels": labels, "loss_mask": torch.tensor([[1.0, 0.0, 1.0]])})
    assert masked.item() == pytest.approx(0.2876821, rel=FP32)
    total = create_cross_entropy_loss("sum")(logits, {"labels": labels})
    assert total.item() == pytest.approx(1.6739765, rel=FP32)
    # Random logits and weights: value and gradient match the naive loop.
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5))
    labels[0, 0] = -100
    mask = torch.rand(3, 5)
    ours = loss_fn(logits, {"labels": labels, "loss_mask": mask})
    (ours_grad,) = torch.autograd.grad(ours, logits)
    naive = _naive_cross_entropy(logits, labels, mask)
    (naive_grad,) = torch.autograd.grad(naive, logits)
    assert ours.item() == pytest.approx(naive.item(), rel=FP32)
    torch.testing.assert_close(ours_grad, naive_grad.float(), rtol=FP32, atol=1e-7)
    with pytest.raises(ValueError, match=r"batch needs 'labels'"):
        loss_fn(logits, {"loss_mask": mask})
    with pytest.raises(ValueError, match=r"loss_mask \(3, 4\) must have the labels' shape"):
        loss_fn(logits, {"labels": labels, "loss_mask": mask[:, :4]})


def _rates(decay, warmup=2, total=6, min_lr_ratio=0.1):
    optimizer = create_adamw_optimizer([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = create_warmup_cosine_scheduler(optimizer, warmup, total, min_lr_ratio, decay)
    rates = []
    for _ in range(total + 1):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_warmup_then_cosine_linear_or_constant():
    # Warm-up (k + 1) / 2 for k = 0, 1; then progress p = (k - 2) / 4 and
    # m + (1 - m) * shape(p), m = 0.1. Cosine shape (1 + cos(pi p)) / 2:
    # p = 1/4: 0.1 + 0.9 * 0.8535534 = 0.8681981; p = 3/4: 0.1 + 0.9 * 0.1464466 = 0.2318019.
    cosine = [0.5, 1.0, 1.0, 0.8681981, 0.55, 0.2318019, 0.1]
    assert _rates("cosine") == pytest.approx(cosine, rel=1e-6)
    assert _rates("linear") == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1], rel=1e-12)
    assert _rates("constant") == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], rel=1e-12)
    with pytest.raises(ValueError, match=r"need 0 <= warmup_steps <= total_steps"):
        _rates("cosine", warmup=7)
    with pytest.raises(ValueError, match=r"min_lr_ratio must be in \[0, 1\], got 1.5"):
        _rates("cosine", min_lr_ratio=1.5)


def _datums():
    return [
        Datum(
            ModelInput.from_ints(list(range(5, 5 + n))),
            {"target_tokens": list(range(6, 6 + n)), "weights": [1.0 / 10] * n},
        )
        for n in (4, 6)
    ]


def test_create_pytorch_backend_on_the_cpu(tiny_model_dir, tmp_path):
    client = create_pytorch_backend(
        tiny_model_dir, tmp_path / "checkpoints", device_type="cpu", learning_rate=1e-3
    )
    try:
        assert isinstance(client, TrainingClient)
        assert (tmp_path / "checkpoints").is_dir()
        client.forward_backward(_datums(), "cross_entropy").result()
        step = client.optim_step().result()
        assert step.metrics is not None and step.metrics["learning_rate:mean"] == 1e-3
        saved = client.save_state("first").result()
        assert saved.path.startswith(str(tmp_path / "checkpoints"))
    finally:
        client.close()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device_type is 'cuda', but CUDA is not available"):
            create_pytorch_backend(tiny_model_dir, device_type="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_create_pytorch_backend_on_a_gpu(tiny_model_dir, tmp_path):
    client = create_pytorch_backend(tiny_model_dir, tmp_path / "checkpoints", gpu_rank=0)
    try:
        client.forward_backward(_datums(), "cross_entropy").result()
        assert client.optim_step().result().metrics is not None
    finally:
        client.close()


def test_the_scheduled_client_has_every_method_of_the_client_it_wraps(tiny_model_dir):
    """Everything the wrapped LocalTrainingClient offers is reachable on the wrapper, and the
    protocols' methods are typed there: pyright checks the two assignments below."""
    client = create_pytorch_backend(tiny_model_dir, device_type="cpu", learning_rate=1e-3)
    training: TrainingClient = client
    custom: CustomLossClient = client
    try:
        inner = client.client
        public = [n for n in dir(inner) if not n.startswith("_") and callable(getattr(inner, n))]
        missing = [n for n in public if not callable(getattr(client, n, None))]
        assert not missing and "save_weights_and_get_sampling_client" in public
        assert isinstance(training, BatchSampler) and isinstance(client, ExportsWeights)

        def summed(data: list[Datum], logprobs: list[torch.Tensor]):
            return -torch.cat(logprobs).sum(), {"n:sum": float(len(logprobs))}

        out = custom.forward_backward_custom(_datums(), summed).result()
        assert out.metrics["n:sum"] == 2.0
        client.optim_step().result()
        sampler = client.save_weights_and_get_sampling_client().result()
        # The snapshot samples the stepped weights: the wrapped client's own logprobs (the
        # first token has none).
        prompt = ModelInput.from_ints([5, 6, 7])
        assert sampler.compute_logprobs(prompt).result()[1:] == pytest.approx(
            client.compute_logprobs(prompt).result()[1:], rel=FP32
        )
    finally:
        client.close()


def test_backend_with_scheduler_steps_by_its_schedule(tiny_model_dir):
    # 4 steps, warm-up max(1, int(4 * 0.25)) = 1: multipliers 1, 1, then cosine at p = 1/3 and
    # 2/3: 0.1 + 0.9 * 0.75 = 0.775 and 0.1 + 0.9 * 0.25 = 0.325.
    client = create_backend_with_scheduler(
        tiny_model_dir,
        num_training_steps=4,
        warmup_ratio=0.25,
        device_type="cpu",
        learning_rate=1e-3,
    )
    try:
        rates = []
        for k in range(4):
            assert client.learning_rate == pytest.approx([1e-3, 1e-3, 7.75e-4, 3.25e-4][k])
            client.forward_backward(_datums(), "cross_entropy").result()
            # Step 3 gets its own AdamParams: the schedule scales the rate it gives.
            adam = AdamParams(learning_rate=2e-3) if k == 3 else None
            metrics = client.optim_step(adam).result().metrics or {}
            rates.append(metrics["learning_rate:mean"])
        assert rates == pytest.approx([1e-3, 1e-3, 7.75e-4, 6.5e-4], rel=1e-12)
        assert client.steps == 4
    finally:
        client.close()
    with pytest.raises(ValueError, match=r"warmup_ratio must be in \[0, 1\], got 2"):
        create_backend_with_scheduler(tiny_model_dir, num_training_steps=4, warmup_ratio=2)


def test_jsonl_logger(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    logger = JSONLLogger(path)
    logger.log({"loss": torch.tensor(0.5), "lr": 1e-3}, step=1)
    # Written through: another reader sees the row before the logger closes.
    assert path.read_text() == '{"step": 1, "loss": 0.5, "lr": 0.001}\n'
    logger.write("train", 2, {"reward": 1.0})  # as a logging_sinks.Sink
    with pytest.raises(TypeError, match=r"object .* is not JSON: log numbers"):
        logger.log({"model": object()})
    with pytest.raises(ValueError, match=r"metrics has a 'step' key and step= was given"):
        logger.log({"step": 3}, step=3)
    logger.close()
    with JSONLLogger(path) as again:  # appends
        again.log({"done": True})
        assert again.read() == [
            {"step": 1, "loss": 0.5, "lr": 0.001},
            {"step": 2, "split": "train", "reward": 1.0},
            {"done": True},
        ]
