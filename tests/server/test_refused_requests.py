"""A refused request never stalls its client: the server answers it 4xx before queueing it, and
its seq_id still takes its turn in the model's order, so the next request runs at once (not
after the 30 s --seq-gap-timeout) and computes what it would have without the refused one.

Against the shared `posttrain serve` (default --seq-gap-timeout of 30 s) with the tinker SDK,
and with raw HTTP for what the SDK cannot send.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from serve_helpers import KEY, ServerProcess, post, result

tinker = pytest.importorskip("tinker")
types = tinker.types
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

# Each test talks to a `posttrain serve` subprocess (seconds to start, more on a busy CPU).
pytestmark = pytest.mark.slow

# A stalled request waits the 30 s gap timeout; an unstalled one takes ~0.1 s on the tiny model.
# 10 s leaves room for a loaded 2-core machine and still fails any stall.
PROMPT_SECONDS = 10.0
TOKENS = [10, 72, 101, 108, 108, 111]
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def service(server: ServerProcess) -> Iterator[object]:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client
    client.close("success").result()


def datum(tokens: list[int], targets: int | None = None):
    n = len(tokens) - 1 if targets is None else targets
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1 : 1 + n], "weights": [1.0] * n},
    )


def train_step(tc) -> tuple[float, float]:
    """forward_backward and optim_step submitted together (pipelined, as trainers do)."""
    backward = tc.forward_backward([datum(TOKENS)], "cross_entropy")
    step = tc.optim_step(ADAM)
    loss = backward.result().metrics["loss:sum"]
    return loss, step.result().metrics["grad_norm:mean"]


def bad_path(tc, sampler_path: str) -> None:
    tc.load_state("tinker://session-none:train:0/weights/nothing").result()


def optimizer_from_sampler(tc, sampler_path: str) -> None:
    tc.load_state_with_optimizer(sampler_path).result()


def targets_shorter_than_input(tc, sampler_path: str) -> None:
    tc.forward_backward([datum(TOKENS, targets=2)], "cross_entropy").result()


@pytest.mark.parametrize(
    ("refused", "error", "message"),
    [
        (bad_path, "NotFoundError", "not found"),
        (optimizer_from_sampler, "BadRequestError", "without optimizer state"),
        (targets_shorter_than_input, "BadRequestError", "first dimension must equal"),
    ],
)
def test_the_next_request_runs_at_once_and_is_correct(
    service, tiny_model_dir: Path, refused: Callable, error: str, message: str
) -> None:
    def model():
        return service.create_lora_training_client(
            base_model=str(tiny_model_dir), rank=2, seed=11
        ).result()

    tc, clean = model(), model()
    sampler_path = tc.save_weights_for_sampler("published").result().path
    with pytest.raises(getattr(tinker, error)) as refusal:
        refused(tc, sampler_path)
    assert message in str(refusal.value)
    started = time.monotonic()
    after_refusal = [train_step(tc), train_step(tc)]
    assert time.monotonic() - started < PROMPT_SECONDS
    # Same seed, same calls (a sampler save does not change weights), same process: equal up to
    # float32 rounding (measured equal); the refused request changed nothing.
    for got, want in zip(after_refusal, [train_step(clean), train_step(clean)], strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_a_body_refused_by_the_schema_also_takes_its_turn(
    server: ServerProcess, tiny_model_dir: Path
) -> None:
    session = post(server, "create_session", json={}).json()["session_id"]
    create = {"session_id": session, "model_seq_id": 0, "base_model": str(tiny_model_dir)}
    model_id = result(server, post(server, "create_model", json=create).json()["request_id"])[
        "model_id"
    ]
    refused = post(
        server,
        "optim_step",
        json={"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": "fast"}},
    )
    assert refused.status_code == 422
    assert "adam_params.learning_rate" in refused.json()["detail"]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum(TOKENS)], loss_fn="cross_entropy"
        ),
        model_id=model_id,
        seq_id=2,
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    started = time.monotonic()
    submitted = post(server, "forward_backward", content=body)
    outcome = result(server, submitted.json()["request_id"])
    assert time.monotonic() - started < PROMPT_SECONDS
    assert "error" not in outcome, outcome
