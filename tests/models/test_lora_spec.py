"""One LoRA spec (`LoraSettings`) with one default rank, Tinker's 32, at every entry point:
`TrainableModel`, `create_training_client`, the server's create path (the Tinker SDK's
`LoraConfig`), and the job's `[model]` table, which builds the same spec from the same keys."""

from __future__ import annotations

import inspect

from posttrain.backends.model import TrainableModel
from posttrain.clients.create import create_training_client
from posttrain.jobs.config import load_config, parse_config
from posttrain.models.lora import DEFAULT_LORA_RANK, LoraSettings
from posttrain.server.tinker_schema import LoraConfig


def test_every_entry_point_defaults_to_one_rank():
    assert DEFAULT_LORA_RANK == 32  # Tinker's create_lora_training_client(rank=32)
    assert LoraSettings().rank == DEFAULT_LORA_RANK
    model = TrainableModel(name="m", project="p", base_model="b")
    assert model.lora == LoraSettings(rank=32, alpha=32.0)
    signature = inspect.signature(create_training_client)
    assert signature.parameters["lora_rank"].default == DEFAULT_LORA_RANK
    assert LoraConfig().rank == DEFAULT_LORA_RANK  # what `posttrain serve` gives the SDK
    # A job whose [model] names no rank (or that has no [model] table) trains the same LoRA.
    assert parse_config({}).model.lora_rank == DEFAULT_LORA_RANK
    assert parse_config({"model": {"base_model": "tiny:qwen2:tiny"}}).model.lora == model.lora


def test_a_job_without_lora_rank_trains_rank_32_lora(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[run]\ntask = "reverse"\n[model]\nbase_model = "tiny:qwen2:tiny"\n')
    # alpha unset: default_alpha(32) = 32, so the adapter scale alpha / rank is 1.
    assert load_config(path).model.lora == LoraSettings(rank=32, alpha=32.0)
    assert (
        load_config(path).model.lora == TrainableModel(name="m", project="p", base_model="b").lora
    )


def test_the_job_table_and_the_model_build_the_same_spec():
    table = {"lora_rank": 4, "train_mlp": False, "train_unembed": True}
    job = parse_config({"model": table}).model
    model = TrainableModel(name="m", project="p", base_model="b", **table)
    # alpha unset: default_alpha(4) = 32 (Tinker's fixed alpha up to rank 32).
    want = LoraSettings(rank=4, alpha=32.0, train_mlp=False, train_unembed=True)
    assert job.lora == model.lora == want


def test_rank_zero_or_none_is_full_fine_tuning_everywhere():
    assert LoraSettings.of(0) is None and LoraSettings.of(None) is None
    # The job's [model] trains every weight with lora_rank = 0, as TOML spells None.
    assert parse_config({"model": {"lora_rank": 0}}).model.lora is None
    assert TrainableModel(name="m", project="p", base_model="b", lora_rank=0).lora is None
    # A rank above 32 gets alpha = rank, so alpha / rank stays 1.
    assert LoraSettings.of(64) == LoraSettings(rank=64, alpha=64.0)
