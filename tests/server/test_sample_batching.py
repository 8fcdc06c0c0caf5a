"""Tinker sample requests of different samplers batched in one compute job
(`server.sample_batching`): fair batch forming in-process, and through a real `posttrain
serve` with the official tinker SDK, batched results equal to each request alone."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from serve_helpers import KEY, ServerProcess

from posttrain.server.sample_batching import PendingSample, SampleGatherer
from posttrain.server.store import SamplerRow
from posttrain.types import ModelInput, SamplingParams


def pending(tenant: str, k: int, n: int = 1) -> PendingSample:
    row = SamplerRow(f"sampler-{tenant}", tenant, None, "base", None, None, None)
    return PendingSample(
        f"{tenant}-{k}", tenant, row, ModelInput.from_ints([1]), n, SamplingParams()
    )


def gatherer(max_rows: int) -> SampleGatherer:
    def unused(*args: object) -> object:
        raise AssertionError("take() runs nothing")

    g = SampleGatherer(unused, unused, unused, unused, max_rows=max_rows)  # pyright: ignore[reportArgumentType]
    g._draining = True  # no event loop here: take() is called by hand
    return g


def test_batches_take_tenants_round_robin_so_a_flood_does_not_fill_them() -> None:
    g = gatherer(max_rows=4)
    for k in range(10):
        g.add(pending("flood", k))
    g.add(pending("b", 0))
    g.add(pending("c", 0))
    g.add(pending("c", 1))
    first = [p.request_id for p in g.take()]
    # One request per tenant per turn: the flooder gets 2 of 4 rows, not all 4.
    assert first == ["flood-0", "b-0", "c-0", "flood-1"]
    # The flooder went last in the turn order, so c (waiting) leads the next batch.
    assert [p.request_id for p in g.take()] == ["c-1", "flood-2", "flood-3", "flood-4"]
    assert [p.request_id for p in g.take()] == ["flood-5", "flood-6", "flood-7", "flood-8"]
    assert [p.request_id for p in g.take()] == ["flood-9"]
    assert g.take() == []


def test_a_batch_stops_at_max_rows_but_a_large_first_request_goes_alone() -> None:
    g = gatherer(max_rows=4)
    g.add(pending("a", 0, n=6))
    g.add(pending("b", 0, n=3))
    g.add(pending("c", 0, n=1))
    assert [p.request_id for p in g.take()] == ["a-0"]  # 6 rows: alone
    assert [p.request_id for p in g.take()] == ["b-0", "c-0"]  # 3 + 1 rows


PROMPTS = [[10, 72, 101, 108, 108, 111], [10, 87, 111, 114, 108], [256, 40, 41, 42]]


def trained_sampler(service, base: Path, seed: int, tokens: list[int]):
    types = pytest.importorskip("tinker").types
    tc = service.create_lora_training_client(
        base_model=str(base), rank=4 * seed, seed=seed
    ).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return tc.save_weights_and_get_sampling_client()


def stats(server: ServerProcess) -> dict[str, int]:
    response = httpx.get(
        f"{server.url}/api/v1/sample_batching", headers={"X-API-Key": KEY}, timeout=30
    )
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
def test_concurrent_samplers_run_as_one_batch_and_match_alone(
    server: ServerProcess, tiny_model_dir: Path
) -> None:
    tinker = pytest.importorskip("tinker")  # here: the batch-forming tests need no SDK
    types = tinker.types
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    try:
        samplers = [
            trained_sampler(service, tiny_model_dir, 1, [10, 20, 30, 40, 50, 60, 70]),
            trained_sampler(service, tiny_model_dir, 2, [90, 80, 70, 60, 50, 40, 30]),
            service.create_sampling_client(base_model=str(tiny_model_dir)),
        ]
        params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
        prompts = [types.ModelInput.from_ints(p) for p in PROMPTS]
        alone = []
        for sampler, prompt in zip(samplers, prompts, strict=True):
            alone.append(sampler.sample(prompt, 2, params).result())  # one at a time
        # The adapters change what is sampled (else a wrong slot could go unseen).
        base_on_0 = samplers[2].sample(prompts[0], 1, params).result().sequences[0]
        assert base_on_0.logprobs != alone[0].sequences[0].logprobs
        before = stats(server)

        def round_matches_alone(bad_prompt: list[int] | None = None) -> None:
            futures = [s.sample(p, 2, params) for s, p in zip(samplers, prompts, strict=True)]
            bad = None
            if bad_prompt is not None:  # same num_samples and settings: the same batch
                bad = samplers[2].sample(types.ModelInput.from_ints(bad_prompt), 2, params)
            together = [f.result() for f in futures]
            for got, want in zip(together, alone, strict=True):
                assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
                for g, w in zip(got.sequences, want.sequences, strict=True):
                    assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)  # test_multi_lora
            if bad is not None:
                with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
                    bad.result()

        for _attempt in range(5):  # arrivals within the join window are likely, not certain
            round_matches_alone()
            if stats(server)["largest_samplers"] >= 3:
                break
            time.sleep(0.1)
        after = stats(server)
        assert after["largest_samplers"] >= 3, (before, after)
        assert after["multi_sampler_jobs"] > before["multi_sampler_jobs"]
        # A bad request (a token id outside the 260-token vocabulary) fails the batch it is in;
        # retried one by one, only it fails, with its own error.
        round_matches_alone(bad_prompt=[1000])
    finally:
        service.close("success").result()
