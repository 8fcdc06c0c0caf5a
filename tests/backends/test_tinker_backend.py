"""TinkerBackend against a real `posttrain serve` on loopback: register, train and train_sft,
the checkpoint index and resume, sampling, option errors, model.openai_client(), and parity
with LocalBackend on the same train() calls. (Failed steps, damaged checkpoints and
resume_step, on every backend: test_model_lifecycle.py.)"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path
from typing import Literal

import httpx
import pytest
import torch
from safetensors.torch import load_file
from test_openai_client import groups

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.tinker import TinkerBackend
from posttrain.types import SamplingParams

# The server tests' helpers start and stop `posttrain serve` (tests/ is not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serve_helpers import (  # pyright: ignore[reportMissingImports]
    KEY,
    ServerProcess,
    post,
    result,
)

tinker = pytest.importorskip("tinker")

# The server is a subprocess (seconds to start, more on a busy CPU).
pytestmark = pytest.mark.slow

PROMPT = [104, 101, 108, 108, 111, 32]  # "hello " in the tiny byte-level vocabulary
LR = 1e-2


def tinker_backend(server: ServerProcess, path: Path) -> TinkerBackend:
    return TinkerBackend(path, base_url=server.url, api_key=KEY)


def tiny(name: str, tiny_model_dir: Path, seed: int = 0) -> TrainableModel:
    return TrainableModel(
        name=name, project="p", base_model=str(tiny_model_dir), lora_rank=4, seed=seed
    )


def index_of(model: TrainableModel) -> list[dict]:
    lines = (model.directory / "checkpoints.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def model_id_of(backend: TinkerBackend, model: TrainableModel) -> str:
    return str(backend.client(model).sdk_client.model_id)


def is_loaded(server: ServerProcess, model_id: str) -> bool:
    """Whether the server still holds the model: a request of a freed one fails at once with
    "not loaded" (a held one would wait for the seq_ids before this one, then fail)."""
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    body = {"model_id": model_id, "seq_id": 10**6, "adam_params": adam}
    submitted = post(server, "optim_step", json=body)
    assert submitted.status_code == 200, submitted.text
    return "not loaded" not in result(server, submitted.json()["request_id"]).get("error", "")


async def test_train_checkpoint_and_resume(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend = tinker_backend(server, tmp_path)
    model = tiny("m", tiny_model_dir, seed=3)
    await model.register(backend)
    assert model.step == 0
    paths = []
    for i in range(3):
        result = await backend.train(model, groups(i), learning_rate=LR, loss="ppo")
        assert result.step == model.step == i + 1
        assert result.metrics["num_updates"] == 1 and result.metrics["loss"] != 0
        paths.append(result.checkpoint_path)
    model.run_state = {"cursor": 7}
    trajectories = [t for g in groups(5) for t in g.trajectories]
    sft = await backend.train_sft(model, trajectories, learning_rate=LR, batch_size=4)
    assert sft.step == 4 and sft.metrics["num_updates"] == 2  # 8 trajectories, batches of 4
    paths.append(sft.checkpoint_path)
    index = index_of(model)
    assert [r["step"] for r in index] == [1, 2, 3, 4]
    assert [r["path"] for r in index] == paths
    assert all(
        p.startswith("tinker://") and p.endswith(f"/weights/step-00000{i}")
        for i, p in enumerate(paths, 1)
    )
    assert index[-1]["run_state"] == {"cursor": 7} and index[0]["run_state"] == {}

    sampler = backend.sampling_client(model)
    at_step_4 = (await sampler.compute_logprobs(PROMPT))[1:]  # the first token has none
    # One more step, not checkpointed: the resumed run below must reproduce it.
    extra = await backend.train(model, groups(9), learning_rate=LR, save_checkpoint=False)
    after_extra = (await backend.sampling_client(model).compute_logprobs(PROMPT))[1:]
    await backend.close()

    again = tinker_backend(server, tmp_path)
    resumed = tiny("m", tiny_model_dir, seed=3)
    await resumed.register(again)
    assert resumed.step == 4 and resumed.run_state == {"cursor": 7}  # the latest checkpoint
    # The weights of step 4 (loaded on the server: same code and values, the same logprobs).
    assert (await again.sampling_client(resumed).compute_logprobs(PROMPT))[1:] == pytest.approx(
        at_step_4, rel=1e-6
    )
    # And its optimizer moments: the next step is the one the first run took (same process on
    # the server, same inputs: equal to float32 rounding).
    redo = await again.train(resumed, groups(9), learning_rate=LR, save_checkpoint=False)
    assert redo.step == 5
    assert redo.metrics["loss"] == pytest.approx(extra.metrics["loss"], rel=1e-6)
    assert redo.metrics["grad_norm"] == pytest.approx(extra.metrics["grad_norm"], rel=1e-6)
    assert (await again.sampling_client(resumed).compute_logprobs(PROMPT))[1:] == pytest.approx(
        after_extra, rel=1e-6
    )
    await again.close()


async def test_sampling(server: ServerProcess, tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = tinker_backend(server, tmp_path)
    model = tiny("s", tiny_model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await model.register(backend)
        await backend.train(model, groups(0), learning_rate=LR, save_checkpoint=False)
        sampler = backend.sampling_client(model)
        response = await sampler.sample(PROMPT, 3, SamplingParams(max_tokens=6, seed=1))
    # The SDK flags its deprecated `*_async` methods with a FutureWarning; none is used.
    assert not [w for w in caught if "DEPRECATED" in str(w.message)]
    assert len(response.sequences) == 3
    for sequence in response.sequences:
        assert 1 <= len(sequence.tokens) <= 6
        assert sequence.logprobs is not None and len(sequence.logprobs) == len(sequence.tokens)
        # Sampled logprobs are the teacher-forced ones of the trained weights (temperature 1).
        forced = await sampler.compute_logprobs(PROMPT + sequence.tokens)
        assert forced[len(PROMPT) :] == pytest.approx(sequence.logprobs, rel=1e-4, abs=1e-5)
    same_seed = await sampler.sample(PROMPT, 3, SamplingParams(max_tokens=6, seed=1))
    assert [s.tokens for s in same_seed.sequences] == [s.tokens for s in response.sequences]
    await backend.close()


async def test_a_generator_trains_what_its_list_trains(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A generator of groups (and of SFT trajectories) is read once and trained whole: it used
    to give 0 trajectories and still advance and checkpoint the step. Two models of one seed
    on the same server process, list vs generator: the same losses (float32 rounding)."""
    backend = tinker_backend(server, tmp_path)
    metrics = []
    for name in ("listed", "generated"):
        model = tiny(name, tiny_model_dir, seed=5)
        await model.register(backend)
        rl_groups = groups(3)
        trajectories = [t for g in groups(4) for t in g.trajectories]
        if name == "generated":
            rl = await backend.train(model, (g for g in rl_groups), learning_rate=LR)
            sft = await backend.train_sft(
                model, (t for t in trajectories), learning_rate=LR, batch_size=4
            )
        else:
            rl = await backend.train(model, rl_groups, learning_rate=LR)
            sft = await backend.train_sft(model, trajectories, learning_rate=LR, batch_size=4)
        metrics.append((rl.metrics, sft.metrics))
    (rl, sft), (rl_gen, sft_gen) = metrics
    assert rl_gen["num_trajectories"] == rl["num_trajectories"] > 0
    assert sft_gen["num_trajectories"] == sft["num_trajectories"] == 8
    assert sft_gen["num_updates"] == sft["num_updates"] == 2
    assert (rl_gen["loss"], sft_gen["loss"]) == pytest.approx((rl["loss"], sft["loss"]), rel=1e-6)
    await backend.close()


async def test_a_base_model_only_the_server_has_is_refused_before_the_service_makes_it(
    server: ServerProcess, tmp_path: Path
) -> None:
    """TinkerBackend loads the base model's tokenizer here: a name this process cannot load
    (the server builds `tiny:` specs on its side) is refused up front, so the service makes no
    model to free. (Failures after the service made it: tests/backends/test_register_failures.py.)"""

    def runs() -> int:
        response = httpx.get(f"{server.url}/api/v1/training_runs", headers={"X-API-Key": KEY})
        return int(response.json()["cursor"]["total_count"])

    before = runs()
    backend = tinker_backend(server, tmp_path / "runs")
    model = TrainableModel(name="t", project="p", base_model="tiny:qwen2:tiny:0", lora_rank=4)
    with pytest.raises(FileNotFoundError, match=r"'tiny:qwen2:tiny:0'.*make-tiny-model"):
        await model.register(backend)
    assert runs() == before
    assert not (tmp_path / "runs" / "p" / "models" / "t" / "model.json").exists()
    await backend.close()


async def test_a_failed_publish_fails_the_step_whole(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A model served OpenAI-style publishes its weights inside the step: a publish that fails
    fails the step like any other part of it (no step counted, the last checkpoint restored
    and published), and the retry is the step an uninterrupted run takes."""

    async def run(name: str, fail: bool) -> tuple[int, list[float | None], list[int]]:
        backend = tinker_backend(server, tmp_path / name)
        model = tiny(name, tiny_model_dir, seed=5)
        await model.register(backend)
        await backend.train(model, groups(1), learning_rate=LR)
        published = model.inference_model_name  # serves step 1's weights from now on
        if fail:
            failed_model = model_id_of(backend, model)
            # A file where the model's sampler checkpoints go: the next one cannot be written.
            samplers = server.storage / "runs" / failed_model.replace(":", "_") / "sampler_weights"
            shutil.rmtree(samplers)
            samplers.write_text("")
            # The OS error depends on how the checkpoint is written (engine.checkpoint).
            blocked = r"(File exists|Not a directory).*sampler_weights"
            with pytest.raises(tinker.RequestFailedError, match=blocked):
                await backend.train(model, groups(2), learning_rate=LR)
            assert model.step == 1 and [r["step"] for r in index_of(model)] == [1]
            assert not is_loaded(server, failed_model)
            # The restored weights are published from the new model, under its own name.
            assert model.inference_model_name != published
            published = model.inference_model_name
        result = await backend.train(model, groups(2), learning_rate=LR)
        assert model.inference_model_name == published
        logprobs = await backend.sampling_client(model).compute_logprobs(PROMPT)
        out = await model.openai_client().completions.create(
            model=published, prompt=PROMPT, max_tokens=6, seed=2
        )
        await backend.close()
        return result.step, logprobs[1:], out.choices[0].model_extra["token_ids"]  # pyright: ignore[reportOptionalSubscript]

    failed_once, clean = await run("publish-failed", True), await run("publish-clean", False)
    assert failed_once[0] == clean[0] == 2
    # Same server process and inputs: the reloaded state gives the same step to float32 rounding.
    assert failed_once[1] == pytest.approx(clean[1], rel=1e-6)
    assert failed_once[2] == clean[2]  # and /v1 serves the retried step's weights


async def test_options_it_lacks_fail_before_any_work(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend = tinker_backend(server, tmp_path)
    model = tiny("o", tiny_model_dir)
    await model.register(backend)
    with pytest.raises(TypeError, match="kl_penalty_coef"):
        await backend.train(model, groups(0), kl_penalty_coef=0.1)  # pyright: ignore[reportCallIssue]
    with pytest.raises(TypeError, match=r"'epochz'.*did you mean 'epochs'"):
        await backend.train_sft(model, [], epochz=2)  # pyright: ignore[reportCallIssue]
    for loss in ("gspo", "dro"):
        with pytest.raises(ValueError) as refused:
            await backend.train(model, groups(0), loss=loss)  # pyright: ignore[reportArgumentType]
        message = str(refused.value)
        assert f"loss={loss!r}" in message
        assert all(name in message for name in ("'ppo'", "'cispo'", "'importance_sampling'"))
    assert model.step == 0 and not (model.directory / "checkpoints.jsonl").exists()
    await backend.close()


async def test_openai_client_serves_the_latest_weights(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend = tinker_backend(server, tmp_path)
    model = tiny("agent", tiny_model_dir)
    await model.register(backend)
    client = model.openai_client()
    assert str(client.base_url) == f"{server.url}/v1/"
    name = model.inference_model_name
    assert name == f"tinker://{model_id_of(backend, model)}/sampler_weights/openai"

    async def served(name: str) -> tuple[list[int], list[float]]:
        out = await client.completions.create(
            model=name, prompt=PROMPT, max_tokens=6, seed=4, logprobs=0
        )
        choice = out.choices[0]
        return choice.model_extra["token_ids"], choice.logprobs.token_logprobs  # pyright: ignore[reportOptionalSubscript, reportReturnType, reportOptionalMemberAccess]

    async def sampled_now() -> tuple[list[int], list[float]]:
        params = SamplingParams(max_tokens=6, seed=4)
        seq = (await backend.sampling_client(model).sample(PROMPT, 1, params)).sequences[0]
        return seq.tokens, seq.logprobs  # pyright: ignore[reportReturnType]

    def same(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> bool:
        # Two loaded copies of the same weights on the server: same tokens, logprobs to rounding.
        return a[0] == b[0] and a[1] == pytest.approx(b[1], rel=1e-5, abs=1e-6)

    before = await served(name)
    assert same(before, await sampled_now())
    for i in range(2):
        await backend.train(model, groups(i), learning_rate=5e-2, save_checkpoint=False)
        # Each step overwrites the one checkpoint, which the server then serves fresh.
        assert model.inference_model_name == name
        after = await served(name)
        assert same(after, await sampled_now())
        assert not same(after, before)  # a 5e-2 step moves the logprobs far beyond rounding
        before = after
    listing = httpx.get(
        f"{server.url}/api/v1/training_runs/{model_id_of(backend, model)}/checkpoints",
        headers={"X-API-Key": KEY},
    )
    assert [c["checkpoint_id"] for c in listing.json()["checkpoints"]] == ["sampler_weights/openai"]
    latest = name
    chat = await client.chat.completions.create(
        model=latest, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True
    )
    choice = chat.choices[0]
    assert choice.model_extra is not None and choice.logprobs is not None
    assert len(choice.model_extra["token_ids"]) == len(choice.logprobs.content or [])
    await backend.close()


def lora_update(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(after[k] - before[k]).flatten() for k in sorted(before)])


def as_saved(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LocalBackend's parameter names as PEFT saves them (no adapter name)."""
    return {k.replace(".default.", "."): v for k, v in weights.items()}


def server_weights(server: ServerProcess, path: str) -> dict[str, torch.Tensor]:
    saved = load_file(server.checkpoint_dir(path) / "adapter_model.safetensors")
    return {k: v for k, v in saved.items() if "lora_" in k}


async def test_parity_with_local_backend(
    server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The same train() and train_sft() calls on LocalBackend and on TinkerBackend -> posttrain
    serve give the same losses and the same weight updates.

    Both run posttrain's trainer and engine in fp32 on the same seed. What differs: TinkerBackend
    folds the token weights into the advantages (one more float32 product per token, ~6e-8
    relative), and the server runs with one thread while this process may use more (another
    summation order, ~1e-7 relative). Adam passes such relative gradient errors through almost
    unchanged where |g| >> eps, so the updates differ by ~1e-7 relative at most. Measured with
    OMP_NUM_THREADS=1 here too: one loss of four off by 7e-8 relative, updates bit-identical
    (Δ ~ 1e-2 differences of ~1e-9 vanish in the weights' rounding). We allow 1e-5 on both
    (compared on the updates, not the whole weights, which would dilute an error ~100x). A
    lost weight, a wrong clip or a skipped step is off by orders of magnitude more.
    """
    local_backend = LocalBackend(tmp_path / "local")
    remote_backend = tinker_backend(server, tmp_path / "remote")
    local, remote = tiny("parity", tiny_model_dir, seed=11), tiny("parity", tiny_model_dir, seed=11)
    await local.register(local_backend)
    await remote.register(remote_backend)
    worker = local_backend.client(local).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]

    def local_weights() -> dict[str, torch.Tensor]:
        params = worker.trainable_parameters().items()
        return as_saved({n: p.detach().clone() for n, p in params})

    initial = local_weights()
    initial_remote = server_weights(server, await remote_backend.checkpoint(remote))
    assert initial_remote.keys() == initial.keys()
    assert all(torch.equal(initial[k], initial_remote[k]) for k in initial)  # same seed, same init

    trajectories = [t for g in groups(7) for t in g.trajectories]
    losses = []
    for backend, model in ((local_backend, local), (remote_backend, remote)):
        steps = [
            await backend.train(
                model, groups(i), learning_rate=LR, loss="ppo", save_checkpoint=False
            )
            for i in range(3)
        ]
        sft = await backend.train_sft(
            model, trajectories, learning_rate=LR, batch_size=4, save_checkpoint=False
        )
        losses.append([r.metrics["loss"] for r in (*steps, sft)])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)

    local_update = lora_update(local_weights(), initial)
    remote_update = lora_update(
        server_weights(server, await remote_backend.checkpoint(remote)), initial
    )
    relative = float((remote_update - local_update).norm() / local_update.norm())
    print(f"parity: losses {losses}, relative update difference {relative:.2e}")
    assert relative < 1e-5
    await local_backend.close()
    await remote_backend.close()


# The per-token statistics a step reports (TrainResult.metrics), all means over its trainable
# tokens. What the loss needs travels on the wire; which tokens count does not (Tinker takes no
# mask), so these must be computed where the mask is known.
TOKEN_METRICS = ("ratio", "clipped_frac", "logprobs", "entropy")


@pytest.mark.parametrize(
    ("loss", "level"),
    [
        ("ppo", "token"),
        ("cispo", "token"),
        ("importance_sampling", "token"),
        # Through forward_backward_custom: the sequence ratio runs here, on returned logprobs.
        ("ppo", "sequence"),
    ],
)
async def test_step_metrics_match_local_backend(
    server: ServerProcess,
    tiny_model_dir: Path,
    tmp_path: Path,
    loss: Literal["ppo", "cispo", "importance_sampling"],
    level: Literal["token", "sequence"],
) -> None:
    """One step on each backend from the same initial weights: the same per-token metrics.

    The data's sampler logprobs are -5.5 + U(0, 1), the model's ~-5.5: ratios ~0.6 and under
    PPO some clip. Both sides compute them in fp32 from the same weights, the server's logprobs
    coming back in float32 (exact), after a summation order that may differ by ~1e-7
    relative, so 1e-5 relative holds with room. Counting the prompt's tokens (advantage and
    sampler logprob 0 there, ratio exp(lp) ~ 4e-3) halved the ratio's mean (0.29 against 0.60).
    """
    metrics = []
    for backend in (LocalBackend(tmp_path / "local"), tinker_backend(server, tmp_path / "remote")):
        model = tiny(f"metrics-{loss}", tiny_model_dir, seed=3)
        await model.register(backend)
        result = await backend.train(
            model,
            groups(5),
            learning_rate=LR,
            loss=loss,
            importance_sampling_level=level,
            save_checkpoint=False,
        )
        metrics.append(result.metrics)
        await backend.close()
    local, remote = metrics
    for name in TOKEN_METRICS:
        assert remote[name] == pytest.approx(local[name], rel=1e-5), name
    assert remote["loss"] == pytest.approx(local["loss"], rel=1e-5)
    assert local["clipped_frac"] > 0 or loss != "ppo"  # the clip's count is compared too
