"""The official tinker SDK (0.38.0) against a real `posttrain serve` process on loopback."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from serve_helpers import KEY, ServerProcess
from transformers import AutoTokenizer

from posttrain.clients.create import create_training_client
from posttrain.types import AdamParams
from posttrain.types import Datum as PtDatum
from posttrain.types import ModelInput as PtModelInput

tinker = pytest.importorskip("tinker")
types = tinker.types

# Each test talks to a `posttrain serve` subprocess (seconds to start, more on a busy CPU).
pytestmark = pytest.mark.slow

TOKENS = [[10, 72, 101, 108, 108, 111], [10, 87, 111, 114, 108, 100, 33, 33]]
RANK = 4


@pytest.fixture(scope="module")
def service(server: ServerProcess) -> Iterator[object]:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client
    client.close("success").result()  # POST sessions/{id}/finish


def sft_datum(tokens: list[int], weights: list[float] | None = None):
    inputs, targets = tokens[:-1], tokens[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(inputs),
        loss_fn_inputs={"target_tokens": targets, "weights": weights or [1.0] * len(targets)},
    )


def rl_datum(tokens: list[int], logprobs: list[float], advantages: list[float]):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": logprobs,
            "advantages": advantages,
        },
    )


def logprobs_of(out) -> list[list[float]]:
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def test_training_flow(service, server: ServerProcess, tiny_model_dir: Path) -> None:
    tc = service.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=RANK, seed=0, user_metadata={"renderer_name": "x"}
    ).result()
    data = [sft_datum(t) for t in TOKENS]
    losses = []
    for _ in range(4):
        out = tc.forward_backward(data, "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    # Adam at lr 1e-2 on two fixed sequences: each step lowers the loss
    # (measured 67.7, 61.6, 46.8, 46.7).
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.85 * losses[0]

    # The RL losses, fed the model's own logprobs so every ratio r = exp(lp - q) is exactly 1.
    old = logprobs_of(tc.forward(data, "cross_entropy").result())
    adv = [[0.5 * (i % 3) - 0.5 for i in range(len(lp))] for lp in old]
    rl = [rl_datum(t, lp, a) for t, lp, a in zip(TOKENS, old, adv, strict=True)]
    adv_sum = sum(sum(a) for a in adv)
    lp_adv = sum(
        x * a for lp, aa in zip(old, adv, strict=True) for x, a in zip(lp, aa, strict=True)
    )
    expected = {
        "importance_sampling": -adv_sum,  # -Σ r·A with r = 1
        "ppo": -adv_sum,  # -Σ min(r·A, clip(r)·A) with r = 1 inside the clip range
        "cispo": -lp_adv,  # -Σ sg(clip(r))·lp·A with r = 1
    }
    for loss_fn, value in expected.items():
        out = tc.forward_backward(rl, loss_fn).result()
        assert out.metrics["loss:sum"] == pytest.approx(value, rel=1e-5, abs=1e-5), loss_fn
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    path = tc.save_state("step-5").result().path
    assert path == f"tinker://{tc.model_id}/weights/step-5"
    before = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    # Same weights, same code, same process: the loss is bit-identical.
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == before

    named = resumed.save_weights_for_sampler("for-sampling").result().path
    assert named == f"tinker://{resumed.model_id}/sampler_weights/for-sampling"
    from_path = service.create_sampling_client(model_path=named)
    sampler = resumed.save_weights_and_get_sampling_client().result()  # ephemeral snapshot
    prompt = types.ModelInput.from_ints(TOKENS[0])
    resp = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=3)).result()
    assert len(resp.sequences) == 3
    assert len({s.sequence_id for s in resp.sequences}) == 3
    for seq in resp.sequences:
        assert 1 <= len(seq.tokens) <= 6
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
    prompt_lps = sampler.compute_logprobs(prompt).result()
    assert prompt_lps[0] is None and len(prompt_lps) == len(TOKENS[0])
    # The sampler holds the trained weights: its prompt logprobs are the trainer's.
    trainer_lps = logprobs_of(resumed.forward([sft_datum(TOKENS[0])], "cross_entropy").result())[0]
    assert prompt_lps[1:] == pytest.approx(trainer_lps, rel=1e-4, abs=1e-5)
    assert from_path.compute_logprobs(prompt).result() == prompt_lps

    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    run = rest.get_training_run_by_tinker_path(path).result()
    assert run.user_metadata == {"renderer_name": "x"}
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == path
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [path]


def test_forward_backward_matches_in_process_client(service, tiny_model_dir: Path) -> None:
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=RANK, seed=7)
    tc = tc.result()
    local = create_training_client(tiny_model_dir, lora_rank=RANK, seed=7)
    weights = [[0.25 * (i % 4) for i in range(len(t) - 1)] for t in TOKENS]
    remote_data = [sft_datum(t, w) for t, w in zip(TOKENS, weights, strict=True)]
    local_data = [
        PtDatum(
            model_input=PtModelInput.from_ints(t[:-1]),
            loss_fn_inputs={"target_tokens": t[1:], "weights": w},
        )
        for t, w in zip(TOKENS, weights, strict=True)
    ]
    adam = types.AdamParams(learning_rate=1e-2)

    for _ in range(2):
        remote = tc.forward_backward(remote_data, "cross_entropy").result()
        mine = local.forward_backward(local_data, "cross_entropy").result()
        # Same code, seed and fp32 CPU math in two processes; only the thread count may differ
        # (the server runs with OMP_NUM_THREADS=1), which reorders float sums: ~1e-6 relative.
        assert remote.metrics["loss:sum"] == pytest.approx(mine.metrics["loss:sum"], rel=1e-5)
        for r, m in zip(logprobs_of(remote), mine.loss_fn_outputs, strict=True):
            assert torch.allclose(torch.tensor(r), m["logprobs"], rtol=1e-5, atol=1e-6)
        tc.optim_step(adam).result()
        local.optim_step(AdamParams(learning_rate=1e-2)).result()
    local.close()


def test_fractional_weights_string_stops_and_bad_loss(service, tiny_model_dir: Path) -> None:
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=RANK).result()
    weights = [0.25, -0.5, 1.5, 0.0, 0.125]
    plain = sft_datum(TOKENS[0], weights)
    # Provenance spans travel in the request and are accepted (posttrain does not use them).
    datum = types.Datum(
        model_input=plain.model_input,
        loss_fn_inputs=plain.loss_fn_inputs,
        model_input_spans=[types.PromptProvenanceSpan(sequence_id="p0", length=len(weights))],
        loss_fn_input_spans=[types.SampledProvenanceSpan(sequence_id="s0", length=len(weights))],
    )
    out = tc.forward([datum], "cross_entropy").result()
    lps = logprobs_of(out)[0]
    # cross_entropy is -Σ w_t·lp_t, weights taken as given (fractional, negative, zero).
    expected = -sum(w * lp for w, lp in zip(weights, lps, strict=True))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)

    with pytest.raises(tinker.RequestFailedError) as failed:
        tc.forward_backward([datum], "stable_reinforce").result()
    assert "stable_reinforce" in str(failed.value)
    # A failed forward_backward does not poison the client: the next request runs.
    assert tc.forward([datum], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        out.metrics["loss:sum"]
    )

    sampler = service.create_sampling_client(base_model=str(tiny_model_dir))
    stops = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    params = types.SamplingParams(max_tokens=40, seed=0, stop=stops, temperature=1.0)
    resp = sampler.sample(types.ModelInput.from_ints(TOKENS[0]), 4, params).result()
    stopped = [s for s in resp.sequences if s.stop_reason == "stop"]
    assert stopped, "no sequence hit a stop string in 40 tokens"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for seq in stopped:
        # The stop text is part of the returned tokens, and only the last token completed it
        # (special tokens count as their text, e.g. <|im_start|> holds 'a').
        text = tokenizer.decode(seq.tokens, skip_special_tokens=False)
        before = tokenizer.decode(seq.tokens[:-1], skip_special_tokens=False)
        assert any(s in text for s in stops)
        assert not any(s in before for s in stops)
