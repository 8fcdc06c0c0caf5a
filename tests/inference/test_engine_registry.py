"""The engine registry (`inference/engines.py`): every optional sampling field is honoured or
refused by name by each engine, and each [inference] config selects exactly one of its modes."""

from __future__ import annotations

import dataclasses

import pytest

from posttrain.inference import InferenceConfig
from posttrain.inference.engines import ENGINES, OPTIONAL_SAMPLING
from posttrain.types import SamplingParams

# A value other than the neutral one for each optional field.
ASKED = {
    "top_k": 5,
    "top_p": 0.9,
    "min_p": 0.1,
    "repetition_penalty": 1.3,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "entropies": True,
}


def test_the_optional_fields_are_samplingparams_defaults_and_each_has_a_test_value():
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert set(ASKED) == set(OPTIONAL_SAMPLING)
    assert all(OPTIONAL_SAMPLING[name] == defaults[name] for name in OPTIONAL_SAMPLING)


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("field", list(ASKED))
def test_each_engine_honours_a_field_or_refuses_it_by_name(engine: str, field: str):
    spec = ENGINES[engine]  # pyright: ignore[reportArgumentType]
    refused = spec.refused_sampling(SamplingParams(**{field: ASKED[field]}))
    if field in spec.sampling:
        assert refused is None
    else:
        assert refused is not None and f"the {engine} engine" in refused
        assert (field in refused) or (field == "entropies" and "token entropies" in refused)
    assert spec.refused_sampling(SamplingParams()) is None


def test_pytorch_honours_every_field_and_the_others_only_the_base_ones():
    assert ENGINES["pytorch"].sampling == frozenset(OPTIONAL_SAMPLING)
    assert ENGINES["vllm"].sampling == ENGINES["openai"].sampling == frozenset()


@pytest.mark.parametrize(
    ("config", "placement", "route"),
    [
        (InferenceConfig(), "here", "merge"),
        (InferenceConfig(devices="cpu,cpu"), "process", "merge"),
        (InferenceConfig(engine="vllm"), "process", "merge"),
        (InferenceConfig(engine="vllm", devices="cuda:0,cuda:1"), "process", "adapter"),
        (InferenceConfig(engine="vllm", lora_sync="adapter"), "process", "adapter"),
        (InferenceConfig(engine="openai", url="http://h/v1"), "server", "merge"),
    ],
)
def test_each_config_selects_one_mode(config: InferenceConfig, placement: str, route: str):
    assert config.placement == placement and config.lora_route() == route
    assert config.mode in config.spec.modes and config.mode.placement == placement
    assert config.split == (placement == "process")
