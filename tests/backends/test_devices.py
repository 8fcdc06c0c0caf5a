"""device="auto" is the default (CUDA where there is CUDA, else the CPU); an explicit CUDA device
the machine lacks is a clear error when the backend is built, naming the option and the fix.
It used to be a bare AssertionError at register. The CUDA errors are checked on a machine
without CUDA (this CPU runner); on a GPU machine they are skipped."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.ray import RayBackend
from posttrain.cli.main import main
from posttrain.clients.create import create_training_client

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
HERE = "cuda" if torch.cuda.is_available() else "cpu"


async def test_auto_is_the_default_and_picks_this_machines_device(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path)
    assert backend.device == HERE
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    worker = backend.client(model).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    assert next(worker.model.parameters()).device.type == HERE
    await backend.close()
    # Ray workers may run elsewhere: "auto" follows their GPU share, not this machine.
    assert RayBackend(tmp_path).device == "cpu"
    assert RayBackend(tmp_path, resources_per_worker={"CPU": 1, "GPU": 1}).device == "cuda"


@no_cuda
def test_cuda_without_cuda_fails_at_construction_naming_the_fix(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError) as caught:
        LocalBackend(tmp_path, device="cuda")
    message = str(caught.value)
    assert message.startswith("LocalBackend device is 'cuda', but CUDA is not available here")
    assert "use device='auto'" in message and "device='cpu'" in message
    with pytest.raises(ValueError, match=r"device is 'cuda:1', but CUDA is not available"):
        create_training_client(tiny_model_dir, device="cuda:1", lora_rank=None)
    assert LocalBackend(tmp_path, device="cpu").device == "cpu"


def test_a_device_torch_does_not_know_and_cuda_without_a_gpu_share(tmp_path):
    with pytest.raises(ValueError, match=r"LocalBackend device is 'gpu', which is not a device"):
        LocalBackend(tmp_path, device="gpu")
    with pytest.raises(
        ValueError, match=r"RayBackend device is 'cuda', but the workers get no GPU"
    ):
        RayBackend(tmp_path, device="cuda")


@no_cuda
def test_a_job_asking_for_cuda_is_refused_by_explain(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text('[run]\ntask = "reverse"\n[backend]\ndevice = "cuda"\n')
    assert main(["explain", str(config), "--json"]) == 1
    [problem] = json.loads(capsys.readouterr().out)["preflight"]["problems"]
    assert problem["option"] == "[backend] device"
    assert problem["message"].startswith("[backend] device is 'cuda', but CUDA is not available")
