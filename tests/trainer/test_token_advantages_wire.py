"""Token-varying advantages cross the Tinker wire intact: TinkerTrainingClient -> `posttrain
serve` gives the loss and gradient of the same datums in this process.

(In process, micro-batches, dp and Ray: test_token_invariance.py, same datums.)

The server reports no gradients, so one optimizer step reads them out: AdamW with beta1 = beta2
= 0 moves each weight by d = -lr g / (|g| + eps) (bias corrections are 1), an invertible
function of g: g = -eps d / (lr - |d|). lr = 100, eps = 1 make d large beside the weights'
float32 spacing, so reading it back costs ~1e-7 relative.

Tolerance, as the LocalBackend parity test (tests/backends/test_tinker_backend.py): both sides
run posttrain's engine in fp32 on the same seed; the wire folds the token weights into the
advantages (one float32 product per token) and the server's thread count may differ (another
summation order), ~1e-7 relative each. 1e-5 on loss and gradient; per-sequence mean advantages,
what a wire that collapsed them would train, are off by more than 1e-2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_token_invariance import datums_for, per_sequence_means

from posttrain.clients.create import create_training_client
from posttrain.clients.tinker import TinkerTrainingClient
from posttrain.models.load import load_tokenizer
from posttrain.types import AdamParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serve_helpers import KEY, ServerProcess  # pyright: ignore[reportMissingImports]

tinker = pytest.importorskip("tinker")
pytestmark = pytest.mark.slow  # a server subprocess

SEED, LR, EPS, REL_TOL = 7, 100.0, 1.0, 1e-5
ADAM = AdamParams(learning_rate=LR, beta1=0.0, beta2=0.0, eps=EPS, grad_clip_norm=0.0)


def gradient_from_step(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]):
    """g of each trainable tensor from one AdamW(beta1=beta2=0) step (module docstring)."""
    out = {}
    for name, w in before.items():
        d = after[name].double() - w.double()
        out[name] = -EPS * d / (LR - d.abs())
    return out


def rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    num = sum(float((a[k] - b[k]).norm() ** 2) for k in a)
    return (num / sum(float(b[k].norm() ** 2) for k in b)) ** 0.5


def local_weights(client) -> dict[str, torch.Tensor]:
    worker = client.dispatch.executor.workers[0]
    params = worker.trainable_parameters().items()
    # As PEFT saves them (no adapter name), to compare with the server's checkpoint.
    return {n.replace(".default.", "."): p.detach().clone() for n, p in params}


def server_weights(server: ServerProcess, remote: TinkerTrainingClient, name: str):
    path = remote.save_state(name).result().path
    saved = load_file(server.checkpoint_dir(path) / "adapter_model.safetensors")
    return {k: v for k, v in saved.items() if "lora_" in k}


def test_token_varying_advantages_cross_the_tinker_wire(server, tiny_model_dir, tmp_path):
    local = create_training_client(
        tiny_model_dir, lora_rank=4, seed=SEED, storage_dir=tmp_path / "local"
    )
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    sdk = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=SEED).result()
    remote = TinkerTrainingClient(sdk, load_tokenizer(tiny_model_dir))
    try:
        datums, config = datums_for(local)  # asserts they really vary within each sequence
        before = local_weights(local)
        assert all(
            torch.equal(before[k], v) for k, v in server_weights(server, remote, "a").items()
        )
        losses, grads = [], []
        for client in (local, remote):
            out = client.forward_backward(datums, config.loss_fn, config.loss_fn_config).result()
            client.optim_step(ADAM).result()
            losses.append(out.metrics["loss:sum"])
        grads.append(gradient_from_step(before, local_weights(local)))
        grads.append(gradient_from_step(before, server_weights(server, remote, "b")))
        flat = local.forward(
            per_sequence_means(datums), config.loss_fn, config.loss_fn_config
        ).result()
        print(f"losses {losses}, relative gradient difference {rel_error(grads[1], grads[0]):.2e}")
        assert losses[1] == pytest.approx(losses[0], rel=REL_TOL)
        assert rel_error(grads[1], grads[0]) < REL_TOL
        assert float(grads[0]["base_model.model.lm_head.lora_B.weight"].norm()) > 0
        # A wire that averaged them per sequence would give another loss entirely.
        assert abs(flat.metrics["loss:sum"] - losses[0]) > 1e-2 * abs(losses[0])
    finally:
        local.close()
        remote.close()
