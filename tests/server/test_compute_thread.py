"""The server's threading model: torch computes on one thread only, whoever asks.

A real server runs in this process (uvicorn on loopback), so module hooks see which thread
builds and runs every model. Two tinker SDK clients (two keys) train and sample at once, and an
OpenAI-compatible request samples a checkpoint: every model built (parameter registration) and
every forward (training with gradients, sampling and prompt logprobs without) must happen on
`Runtime.compute`, and nowhere else.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from serve_helpers import serving
from torch.nn.modules import module as nn_module

from posttrain.server.app import create_app
from posttrain.server.config import ServerConfig

tinker = pytest.importorskip("tinker")
pytest.importorskip("uvicorn")  # serve_helpers.serving runs the app under it
types = tinker.types

# A server, two models and a checkpoint sampler loaded in this process: several seconds.
pytestmark = pytest.mark.slow

TOKENS = [10, 72, 101, 108, 108, 111, 33]


@contextmanager
def torch_threads() -> Iterator[list[tuple[str, int, bool]]]:
    """(what, thread ident, grad enabled) for every parameter registered and forward run."""
    seen: list[tuple[str, int, bool]] = []

    def on_forward(module: torch.nn.Module, args: object) -> None:
        seen.append(("forward", threading.get_ident(), torch.is_grad_enabled()))

    def on_parameter(module: torch.nn.Module, name: str, param: object) -> None:
        seen.append(("build", threading.get_ident(), torch.is_grad_enabled()))

    hooks = [
        nn_module.register_module_forward_pre_hook(on_forward),
        nn_module.register_module_parameter_registration_hook(on_parameter),
    ]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def datum() -> object:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


def test_training_and_sampling_of_two_clients_all_run_on_the_compute_thread(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = ServerConfig(
        base_model="tiny",
        model_path=str(tiny_model_dir),
        db_path=tmp_path / "state.db",
        storage_dir=tmp_path / "storage",
    )
    app = create_app(config)
    runtime = app.state.runtime
    with torch_threads() as seen, serving(app) as url:
        trainer = tinker.ServiceClient(base_url=url, api_key="tml-client-a")
        sampler = tinker.ServiceClient(base_url=url, api_key="tml-client-b")
        training = trainer.create_lora_training_client(base_model="tiny", rank=4).result()
        sampling = sampler.create_sampling_client(base_model="tiny").result()
        prompt = types.ModelInput.from_ints(TOKENS)
        params = types.SamplingParams(max_tokens=8, seed=0)
        # Submitted before any is waited for, so the server has both clients' work at once.
        futures = []
        for _ in range(3):
            futures.append(training.forward_backward([datum()], "cross_entropy"))
            futures.append(training.optim_step(types.AdamParams(learning_rate=1e-3)))
            futures.append(sampling.sample(prompt, 2, params))
            futures.append(sampling.compute_logprobs(prompt))
        for future in futures:
            future.result()
        # A checkpoint sampler, loaded (base model + LoRA weights) by an OpenAI-style request.
        path = training.save_weights_for_sampler("threads").result().path
        completion = httpx.post(
            f"{url}/v1/completions",
            headers={"Authorization": "Bearer tml-client-a"},
            json={"model": path, "prompt": TOKENS, "max_tokens": 4, "seed": 0},
            timeout=60,
        )
        assert completion.status_code == 200, completion.text
        trainer.close("success").result()
        sampler.close("success").result()
    compute = runtime.compute.ident
    assert compute is not None and compute != threading.main_thread().ident
    # Three models were built: the trained one, the base sampler, the checkpoint sampler.
    builds = [ident for what, ident, _ in seen if what == "build"]
    assert builds and set(builds) == {compute}
    forwards = [(ident, grad) for what, ident, grad in seen if what == "forward"]
    assert {grad for _, grad in forwards} == {True, False}  # training and sampling both seen
    assert {ident for ident, _ in forwards} == {compute}
