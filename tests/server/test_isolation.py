"""One tenant's failures leave another's adapter, results and the shared base model untouched.

A victim trains a LoRA adapter (seed 7) twice: alone, then with a hostile client (another key)
failing in every way it can between the victim's requests: a NaN loss (NaN advantages, which
the losses accept: the step is skipped), a loss that overflows to inf (weights of 1e38), a
token id outside the vocabulary, mismatched shapes, datums with different keys, an unknown
loss, and an out-of-memory error midway through its pass. The second victim's forward_backward
and forward outputs, optim_step metrics, and its save_state checkpoint (adapter and optimizer
tensors) equal the first's bit for bit.

Twice: through a `posttrain serve` subprocess, as users run it (no out-of-memory: it needs a
fault injected; the base model's prompt logprobs before and after stand for its weights), and
with the server in this process (uvicorn on loopback, the same SDK), where a LoRA layer of the
hostile model raises torch.OutOfMemoryError and the base weights of every live model (with one
base per server, the same tensors for all) are compared with the base model's files on disk.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from serve_helpers import KEY, OTHER_KEY, ServerProcess, in_process_config, serving

from posttrain.server.app import create_app
from posttrain.server.config import owner_of
from posttrain.server.runtime import Runtime

tinker = pytest.importorskip("tinker")
pytest.importorskip("uvicorn")
types = tinker.types

# A server and three LoRA models in this process: several seconds.
pytestmark = pytest.mark.slow

VICTIM, HOSTILE = "tml-isolation-victim", "tml-isolation-hostile"
TOKENS = [[10, 72, 101, 108, 108, 111], [10, 87, 111, 114, 108, 100, 33, 33]]
ADAM = types.AdamParams(learning_rate=1e-2)


def datum(tokens: list[int], **inputs: list[float] | list[int]) -> Any:
    targets = inputs.pop("target_tokens", tokens[1:])
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": targets, **inputs},
    )


def sft(tokens: list[int], weight: float = 1.0) -> Any:
    return datum(tokens, weights=[weight] * (len(tokens) - 1))


def victim_run(training: Any, between: Callable[[int], None]) -> dict[str, Any]:
    """Three steps of SFT, `between(step)` called while each step's requests are queued, then
    a forward pass and a checkpoint. Returns every output."""
    data = [sft(t) for t in TOKENS]
    out: dict[str, Any] = {}
    for step in range(3):
        backward = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(ADAM)
        between(step)
        fb = backward.result()
        out[f"fb{step}"] = ([o["logprobs"].tolist() for o in fb.loss_fn_outputs], fb.metrics)
        out[f"optim{step}"] = optim.result().metrics
    fwd = training.forward(data, "cross_entropy").result()
    out["forward"] = [o["logprobs"].tolist() for o in fwd.loss_fn_outputs]
    out["checkpoint"] = training.save_state("victim").result().path
    return out


def outcome(future_or_call: Callable[[], Any]) -> Any:
    """The call's result, or the exception it raised (on submission or on `result()`)."""
    try:
        return future_or_call().result()
    except Exception as exc:
        return exc


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter and optimizer tensors of a save_state checkpoint, from its files."""
    tensors = {
        f"adapter/{k}": v for k, v in load_file(folder / "adapter_model.safetensors").items()
    }
    optimizer = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False)
    for index, state in optimizer["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{index}/{key}"] = value
    return tensors


def assert_base_weights_are_the_files(runtime: Runtime, model_dir: Path) -> int:
    """Every frozen (base) parameter of every live model equals model.safetensors; returns how
    many tensors were compared."""
    files = load_file(model_dir / "model.safetensors")
    compared = 0
    for client in runtime.residency.clients_in_memory().values():
        worker = client._in_process_worker()
        assert worker is not None
        for name, param in worker.model.named_parameters():
            if param.requires_grad:
                continue
            key = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert key in files, f"base parameter {name} has no tensor {key} in the files"
            assert torch.equal(param.detach().cpu(), files[key]), f"{name} changed"
            compared += 1
    return compared


def bad_calls(hostile: Any) -> dict[str, Callable[[], Any]]:
    """Every way the hostile client fails, by name; "out of memory" needs a fault injected."""
    tokens, long = TOKENS
    return {
        "nan loss": lambda: hostile.forward_backward(
            [datum(tokens, logprobs=[-1.0] * 5, advantages=[math.nan] * 5)],
            "importance_sampling",
        ),
        "nan step": lambda: hostile.optim_step(ADAM),
        "overflow": lambda: hostile.forward_backward([sft(tokens, 1e38)], "cross_entropy"),
        "overflow step": lambda: hostile.optim_step(ADAM),
        "token id": lambda: hostile.forward_backward(
            [datum(tokens, target_tokens=[10**6] * 5, weights=[1.0] * 5)], "cross_entropy"
        ),
        "shapes": lambda: hostile.forward_backward(
            [datum(tokens, weights=[1.0] * 2)], "cross_entropy"
        ),
        "mixed keys": lambda: hostile.forward_backward(
            [sft(tokens), datum(long, logprobs=[0.0] * 7, advantages=[1.0] * 7)],
            "cross_entropy",
        ),
        "unknown loss": lambda: hostile.forward_backward([sft(tokens)], "no_such_loss"),
        "out of memory": lambda: hostile.forward_backward([sft(long)], "cross_entropy"),
    }


def assert_it_failed_each_way(seen: dict[str, Any], names: Iterable[str]) -> None:
    """The hostile client's NaN and inf losses came back (their steps skipped, grad norm NaN:
    JSON "NaN"), and every other call of `names` failed."""
    for step in range(3):
        assert math.isnan(seen[f"nan loss {step}"].metrics["loss:sum"])
        assert math.isinf(seen[f"overflow {step}"].metrics["loss:sum"])
        for name in ("nan step", "overflow step"):
            metrics = seen[f"{name} {step}"].metrics
            assert metrics["skipped:sum"] == 1.0 and math.isnan(metrics["grad_norm:mean"])
        for name in set(names) - {"nan loss", "nan step", "overflow", "overflow step"}:
            assert isinstance(seen[f"{name} {step}"], Exception), (name, seen)


def assert_same_victim(
    alone: dict[str, Any], shared: dict[str, Any], folder: Callable[[str], Path]
) -> None:
    """Every output of the victim's two runs, and their checkpoints' tensors, are equal."""
    for key in alone:
        if key != "checkpoint":
            assert shared[key] == alone[key], key
    before = checkpoint_tensors(folder(alone["checkpoint"]))
    after = checkpoint_tensors(folder(shared["checkpoint"]))
    assert before.keys() == after.keys() and len(before) > 10
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key


def test_through_a_server_process(server: ServerProcess, tiny_model_dir: Path) -> None:
    """`posttrain serve` as users run it: every failure but the out-of-memory one (which needs
    a fault injected in the process); the base weights are read through the base model's prompt
    logprobs, before and after, which must be equal to the bit."""
    base = str(tiny_model_dir)
    prompt = types.ModelInput.from_ints(TOKENS[1])
    base_sampler = tinker.ServiceClient(base_url=server.url, api_key=OTHER_KEY)
    sampler = base_sampler.create_sampling_client(base_model=base).result()
    base_before = sampler.compute_logprobs(prompt).result()
    alone_service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    alone = victim_run(
        alone_service.create_lora_training_client(base_model=base, rank=4, seed=7).result(),
        lambda step: None,
    )
    hostile_service = tinker.ServiceClient(base_url=server.url, api_key=OTHER_KEY)
    hostile = hostile_service.create_lora_training_client(base_model=base, rank=4, seed=7)
    bad = bad_calls(hostile.result())
    del bad["out of memory"]
    seen: dict[str, Any] = {}

    def fail_between(step: int) -> None:
        for name, call in bad.items():
            seen[f"{name} {step}"] = outcome(call)

    victim_service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    shared = victim_run(
        victim_service.create_lora_training_client(base_model=base, rank=4, seed=7).result(),
        fail_between,
    )
    assert_it_failed_each_way(seen, bad)
    assert_same_victim(alone, shared, server.checkpoint_dir)
    assert sampler.compute_logprobs(prompt).result() == base_before
    for service in (base_sampler, alone_service, hostile_service, victim_service):
        service.close("success").result()


def test_in_process_with_an_out_of_memory(tiny_model_dir: Path, tmp_path: Path) -> None:
    app = create_app(in_process_config(tiny_model_dir, tmp_path, api_keys=(VICTIM, HOSTILE)))
    runtime: Runtime = app.state.runtime
    with serving(app) as url:
        alone_service = tinker.ServiceClient(base_url=url, api_key=VICTIM)
        alone = victim_run(
            alone_service.create_lora_training_client(base_model="tiny", rank=4, seed=7).result(),
            lambda step: None,
        )
        alone_service.close("success").result()

        hostile_service = tinker.ServiceClient(base_url=url, api_key=HOSTILE)
        hostile = hostile_service.create_lora_training_client(
            base_model="tiny", rank=4, seed=7
        ).result()
        (hostile_id,) = [m.model_id for m in runtime.store.models(owner_of(HOSTILE))]
        hostile_worker = runtime.residency.clients_in_memory()[hostile_id]._in_process_worker()
        assert hostile_worker is not None
        # A LoRA layer midway through the hostile model (its own module, with a shared base
        # too) runs out of memory while `armed`: each hostile call is waited for before the
        # next (`outcome`), so exactly the "out of memory" call fails there.
        lora_a = [
            m for n, m in hostile_worker.model.named_modules() if n.endswith("lora_A.default")
        ]

        def out_of_memory(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            if armed:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

        armed: list[bool] = []
        lora_a[len(lora_a) // 2].register_forward_hook(out_of_memory)
        bad = bad_calls(hostile)
        seen: dict[str, Any] = {}

        def fail_between(step: int) -> None:
            for name, call in bad.items():
                if name == "out of memory":
                    armed.append(True)
                seen[f"{name} {step}"] = outcome(call)
                armed.clear()

        victim_service = tinker.ServiceClient(base_url=url, api_key=VICTIM)
        shared = victim_run(
            victim_service.create_lora_training_client(base_model="tiny", rank=4, seed=7).result(),
            fail_between,
        )
        assert_it_failed_each_way(seen, bad)
        assert "out of memory" in str(seen["out of memory 0"]).lower()

        def folder(tinker_path: str) -> Path:
            model_id, _, name = tinker_path.removeprefix("tinker://").split("/")
            return runtime.model_dir(model_id) / "checkpoints" / name

        assert_same_victim(alone, shared, folder)
        # Both live models (victim, hostile) still have the base model's exact weights.
        assert assert_base_weights_are_the_files(runtime, tiny_model_dir) > 0
        hostile_service.close("success").result()
        victim_service.close("success").result()
