"""Exporting a Tinker run: the tinker SDK against a real `posttrain serve` fetches a training
checkpoint's weights (save_weights_external, external_weights_urls, the download URLs), and
`export_model` writes the merged model, whose logprobs equal the served model's."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from serve_helpers import KEY, ServerProcess
from transformers import AutoModelForCausalLM

from local_groups import synthetic_groups
from posttrain.backends.export import PROVENANCE, export_model
from posttrain.backends.model import TrainableModel
from posttrain.backends.tinker import TinkerBackend
from posttrain.cli.main import main

tinker = pytest.importorskip("tinker")
types = tinker.types

pytestmark = pytest.mark.slow
TOKENS = [10, 72, 101, 108, 108, 111, 33]


def _datum() -> object:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


# The SDK's deprecated forms warn with a FutureWarning (create_rest_client, a future used as
# its client): the export path, and this test, use none.
@pytest.mark.filterwarnings("error::FutureWarning")
def test_a_served_lora_run_exports_merged(
    server: ServerProcess,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    tc = service.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, seed=5
    ).result()
    for _ in range(2):
        tc.forward_backward([_datum()], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_state("step-2").result().path
    served = tc.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    served = torch.tensor(served.tolist())
    service.close("success").result()

    result = export_model(path, tmp_path / "out", base_url=server.url, api_key=KEY)
    assert (result.source, result.step, result.form) == (path, None, "merged")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        logits = plain(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    got = torch.log_softmax(logits, -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    gap = (got - served).abs().max().item()
    print(f"tinker export vs served logprobs: max abs gap {gap:.3g}")
    # fp32 both; the server computes W0 x + s B (A x), the export (W0 + s B A) x, and the
    # log-softmax runs over differently summed logits: ~1e-6 relative of logprobs up to ~5
    # (measured 3.8e-6 after two steps at lr 5e-2); a wrong merge moves them by > 1e-2.
    assert gap <= 1e-5
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        moved = (base(input_ids=torch.tensor([TOKENS[:-1]])).logits[0] - logits).abs().max()
    assert moved > 1e-2  # the export holds the training
    record = json.loads((tmp_path / "out" / PROVENANCE).read_text())
    assert record["checkpoint"] == path and record["base_model"] == str(tiny_model_dir)
    # The command names the checkpoint it exported (a tinker:// path has no step).
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    assert main(["export", path, str(tmp_path / "cli"), "--base-url", server.url]) == 0
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith(f"exported {path} (merged, float32) to "), said
    # The temporary external weights were deleted; nothing but the exports is left beside them.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli", "out"]
    run_id = path.removeprefix("tinker://").split("/")[0]
    listed = httpx.get(
        f"{server.url}/api/v1/training_runs/{run_id}/checkpoints", headers={"X-API-Key": KEY}
    ).json()["checkpoints"]
    assert [c["checkpoint_type"] for c in listed] == ["training"]


def test_external_weights_urls_need_the_key_and_their_token(server: ServerProcess, tmp_path):
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    tc = service.create_lora_training_client(
        base_model=server_base(server), rank=4, seed=6
    ).result()
    external = tc.save_weights_external("mine").result().path
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    urls = rest.get_external_weights_urls(external).result().urls
    assert {"adapter_model.safetensors", "adapter_config.json", "checkpoint.json"} <= set(urls)
    # The URL alone downloads (as from a signed bucket URL); a made-up token does not, nor
    # does a path out of the checkpoint.
    assert httpx.get(urls["checkpoint.json"]).status_code == 200
    forged = urls["checkpoint.json"].rsplit("/", 2)[0] + "/forged/checkpoint.json"
    assert httpx.get(forged).status_code == 403
    escape = urls["checkpoint.json"].rsplit("/", 1)[0] + "/..%2F..%2Fstore.db"
    assert httpx.get(escape).status_code == 404
    # The listing endpoint still needs the key.
    run_id = external.removeprefix("tinker://").split("/")[0]
    listing = f"{server.url}/api/v1/training_runs/{run_id}/checkpoints"
    assert httpx.get(listing).status_code == 401
    rest.delete_checkpoint_from_tinker_path(external).result()
    with pytest.raises(ValueError, match="sampler weights"):
        export_model(f"tinker://{run_id}/sampler_weights/x", tmp_path / "o", base_url=server.url)
    service.close("success").result()


def server_base(server: ServerProcess) -> str:
    with httpx.Client() as client:
        answer = client.get(
            f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}
        ).json()
    return answer["supported_models"][0]["model_name"]


async def test_a_tinker_backend_model_directory_exports(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
):
    backend = TinkerBackend(tmp_path / "runs", base_url=server.url, api_key=KEY)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    for step in range(2):
        await backend.train(model, synthetic_groups(step), learning_rate=1e-2)
    await backend.close()
    index = [json.loads(line) for line in (model.directory / "checkpoints.jsonl").open()]
    # The run directory a user has (runs/p, holding models/m), the latest step by default.
    result = export_model(
        tmp_path / "runs" / "p", tmp_path / "out", base_url=server.url, api_key=KEY
    )
    assert (result.step, result.source) == (2, index[-1]["path"])
    first = export_model(
        model.directory, tmp_path / "first", step=1, base_url=server.url, api_key=KEY
    )
    assert (first.step, first.source) == (1, index[0]["path"])
    merged = [AutoModelForCausalLM.from_pretrained(tmp_path / name) for name in ("out", "first")]
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        assert (merged[0](input_ids=ids).logits - merged[1](input_ids=ids).logits).abs().max() > 0
    with pytest.raises(ValueError, match=r"step 5 has no checkpoint .*: 1, 2"):
        export_model(model.directory, tmp_path / "x", step=5, base_url=server.url, api_key=KEY)
