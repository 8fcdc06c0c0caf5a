"""`posttrain serve --max-resident-adapters 2` through the tinker SDK: three training clients
take turns, then send their requests all at once, so each is spilled to disk and reloaded (once
with gradients waiting for their optim_step), and a sampler is dropped and reloaded. Their losses, final weights and AdamW state
are those of the same clients on a server without the limit, to the bit, and the sampler's
greedy tokens are the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from serve_helpers import KEY, ServerProcess, assert_bit_equal, start_server

tinker = pytest.importorskip("tinker")
types = tinker.types

# Two `posttrain serve` subprocesses (seconds to start, more on a busy CPU).
pytestmark = pytest.mark.slow

TOKENS = [[10, 72, 101, 108, 108, 111], [10, 87, 111, 114, 108, 100, 33, 33]]
ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01)
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def limited(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    storage = tmp_path_factory.mktemp("serve-evict") / "storage"
    process = start_server(tiny_model_dir, storage, "--max-resident-adapters", "2")
    yield process
    process.stop()


def data():
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)},
        )
        for t in TOKENS
    ]


def run(server: ServerProcess, model: Path) -> dict[str, object]:
    """Three clients taking turns, then a sampler of the first; what each left behind."""
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    clients = [
        service.create_lora_training_client(base_model=str(model), rank=4, seed=seed).result()
        for seed in (1, 2, 3)
    ]
    losses = []
    for _ in range(2):
        # With room for two, the third forward_backward spills the first with its gradients,
        # which its optim_step then needs back.
        for tc in clients:
            losses.append(tc.forward_backward(data(), "cross_entropy").result().metrics["loss:sum"])
        for tc in clients:
            tc.optim_step(ADAM).result()
    # All at once: three models' requests run together, so a reload waits for a busy adapter.
    for _ in range(2):
        passes = [tc.forward_backward(data(), "cross_entropy") for tc in clients]
        steps = [tc.optim_step(ADAM) for tc in clients]
        losses += [p.result().metrics["loss:sum"] for p in passes]
        for done in steps:
            done.result()
    saved = []
    for tc in clients:
        ckpt = server.checkpoint_dir(tc.save_state("final").result().path)
        optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
        saved.append({"adapter": load_file(ckpt / "adapter_model.safetensors"), "optim": optimizer})
    sampler = clients[0].save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(TOKENS[0])
    first = sampler.sample(prompt, 1, GREEDY).result().sequences[0].tokens
    for tc in clients[1:]:  # two other adapters in use: the sampler leaves memory
        tc.forward(data(), "cross_entropy").result()
    again = sampler.sample(prompt, 1, GREEDY).result().sequences[0].tokens
    service.close("success").result()
    ids = [tc.model_id for tc in clients]
    return {"losses": losses, "saved": saved, "first": first, "again": again, "ids": ids}


def test_evicted_adapters_come_back_bit_exact(
    limited: ServerProcess, server: ServerProcess, tiny_model_dir: Path
) -> None:
    bounded = run(limited, tiny_model_dir)
    unbounded = run(server, tiny_model_dir)  # the shared server: no limit
    log = limited.log.read_text()
    for model_id in bounded["ids"]:  # pyright: ignore[reportGeneralTypeIssues]
        assert f"adapter {model_id} spilled to disk" in log
        assert f"adapter {model_id} reloaded from disk" in log
    assert "left memory" in log  # the sampler
    assert unbounded_log(server) == ""
    assert bounded["losses"] == unbounded["losses"]  # every loss, to the bit
    assert_bit_equal(bounded["saved"], unbounded["saved"])
    assert bounded["again"] == bounded["first"] == unbounded["first"]
    assert len(bounded["first"]) == 8  # pyright: ignore[reportArgumentType]


def unbounded_log(server: ServerProcess) -> str:
    """The shared server's spill and reload lines (there are none without the flag)."""
    lines = server.log.read_text().splitlines()
    return "\n".join(line for line in lines if "posttrain.server.residency" in line)
