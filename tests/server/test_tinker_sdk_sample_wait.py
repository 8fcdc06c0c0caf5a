"""`posttrain serve --max-resident-adapters 1` with two SDK users: one's sampler needs the one
place in memory while the other's training request holds it, so its `sample()` and
`compute_logprobs()` wait for that request to finish, as a training request does, instead of
failing at once; and the wait is bounded: past it, the request fails with an error that says
how long it waited.

The server runs in this process (uvicorn on loopback, the same SDK) so that the test can hold
a training request open for as long as it needs (`Residency.using`, what a request of the model
does while it runs): a real request is over in milliseconds, too soon to tell waiting from
luck."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from serve_helpers import in_process_config, serving

from posttrain.server.app import create_app

tinker = pytest.importorskip("tinker")
pytest.importorskip("uvicorn")
types = tinker.types

# A server and two LoRA models in this process: several seconds.
pytestmark = pytest.mark.slow

PROMPT = [10, 72, 101, 108, 108, 111]
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0)


def datum() -> object:
    return types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)},
    )


def test_a_sample_waits_for_a_busy_adapter_and_not_forever(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    app = create_app(in_process_config(tiny_model_dir, tmp_path, max_resident_adapters=1))
    residency = app.state.runtime.residency
    with serving(app) as url:
        alice = tinker.ServiceClient(base_url=url, api_key="tml-alice")
        bob = tinker.ServiceClient(base_url=url, api_key="tml-bob")
        training = alice.create_lora_training_client(base_model="tiny", rank=4).result()
        bobs = bob.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
        sampler = bobs.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(PROMPT)
        alone = sampler.sample(prompt, 1, GREEDY).result().sequences[0].tokens
        logprobs = sampler.compute_logprobs(prompt).result()

        def bobs_sampler_out() -> None:
            training.forward([datum()], "cross_entropy").result()  # alice's adapter comes back
            assert residency.resident() == [training.model_id]

        bobs_sampler_out()
        with residency.using(training.model_id):  # alice's request runs
            waiting = [sampler.sample(prompt, 1, GREEDY), sampler.compute_logprobs(prompt)]
            # Until both wait (or, as before, fail at once).
            deadline = time.monotonic() + 60
            while residency.sample_waits < 2 and not any(f.future().done() for f in waiting):
                assert time.monotonic() < deadline, "the requests neither waited nor failed"
                time.sleep(0.01)
            assert not any(f.future().done() for f in waiting)
        # Alice's request is over: Bob's sampler takes its place, and samples what it did alone.
        assert waiting[0].result().sequences[0].tokens == alone
        assert waiting[1].result() == logprobs

        bobs_sampler_out()
        residency.wait_s = 0.5
        with residency.using(training.model_id):  # a request longer than the wait
            started = time.monotonic()
            with pytest.raises(tinker.RequestFailedError) as failed:
                sampler.sample(prompt, 1, GREEDY).result()
            waited = time.monotonic() - started
        assert "all 1 resident adapters are busy with requests (waited 0.5 s" in str(failed.value)
        assert "--max-resident-adapters" in str(failed.value)
        assert waited >= 0.5
        # And the server goes on: the sampler samples once the adapter is free.
        assert sampler.sample(prompt, 1, GREEDY).result().sequences[0].tokens == alone
        alice.close("success").result()
        bob.close("success").result()
