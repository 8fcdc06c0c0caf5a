"""The job's TOML config: defaults, pass-through trainer options, and errors that name the fix."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from posttrain.jobs.config import JobConfig, load_config, parse_config
from posttrain.jobs.run_dir import JOB_FILE, config_changes, config_record, prepare_run_dir
from posttrain.jobs.tables import is_secret, parse_tiny_spec
from posttrain.models.lora import DEFAULT_LORA_RANK
from posttrain.trainer.config import RLConfig, SFTConfig, from_options

EXAMPLES = sorted(Path(str(resources.files("posttrain") / "examples")).glob("*.toml"))

LORA_LAYERS = ("train_attn", "train_mlp", "train_unembed")


def test_empty_config_is_all_defaults():
    config = parse_config({})
    assert config == JobConfig()
    assert config.rl.trainer == RLConfig()
    assert config.sft.trainer == SFTConfig()
    assert not config.sft.enabled
    assert config.model.lora_rank == DEFAULT_LORA_RANK  # LoRA unless lora_rank = 0


def test_tables_fill_their_dataclasses_and_trainer_options_pass_through():
    config = parse_config(
        {
            "run": {"task": "addition", "seed": 7},
            "model": {"base_model": "tiny:llama:tiny:3", "lora_rank": 4},
            "sft": {"examples": 10, "batch_size": 4, "lr_schedule": "linear"},
            "rl": {"steps": 3, "group_size": 4, "loss": "cispo", "learning_rate": 1e-4},
            "eval": {"held_out": 20, "every": 2},
        }
    )
    assert config.run.task == "addition" and config.run.seed == 7
    assert config.model.lora_rank == 4
    assert config.sft.examples == 10 and config.sft.enabled
    assert config.sft.trainer == from_options(SFTConfig, dict(batch_size=4, lr_schedule="linear"))
    assert config.rl.steps == 3 and config.rl.group_size == 4
    assert config.rl.trainer == from_options(RLConfig, dict(loss="cispo", learning_rate=1e-4))
    assert config.eval.held_out == 20 and config.eval.every == 2


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"rl": {"learning_rat": 1e-4}},
            r"\[rl\] unknown key 'learning_rat'; did you mean 'learning_rate'\?",
        ),
        (
            {"rl": {"group_sise": 4}},
            r"\[rl\] unknown key 'group_sise'; did you mean 'group_size'\?",
        ),
        ({"sft": {"epoch": 2}}, r"\[sft\] unknown key 'epoch'; did you mean 'epochs'\?"),
        (
            {"model": {"lora_rnk": 2}},
            r"\[model\] unknown key 'lora_rnk'; did you mean 'lora_rank'\?",
        ),
        ({"eval": {"held_ot": 2}}, r"\[eval\] unknown key 'held_ot'; did you mean 'held_out'\?"),
        ({"run": {"sed": 2}}, r"\[run\] unknown key 'sed'; did you mean 'seed'\?"),
        ({"rll": {"steps": 2}}, r"unknown table \[rll\]; did you mean 'rl'\?"),
        ({"run": {"zzzzzz": 2}}, r"\[run\] unknown key 'zzzzzz'$"),  # nothing close: no guess
    ],
)
def test_unknown_keys_name_the_table_the_key_and_the_nearest(data, message):
    with pytest.raises(ValueError, match=message):
        parse_config(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"rl": {"group_size": 1}}, r"\[rl\] group_size must be >= 2"),
        ({"rl": {"steps": -1}}, r"\[rl\] steps must be >= 0"),
        ({"rl": {"temperature": 0.0}}, r"\[rl\] temperature must be > 0"),
        ({"rl": {"steps": "10"}}, r"\[rl\] option steps='10' is invalid: expected int"),
        ({"rl": {"loss": "ppo2"}}, r"\[rl\] option loss='ppo2' is invalid: expected one of 'ppo'"),
        (
            {"rl": {"num_minibatches": 0}},
            r"\[rl\] option num_minibatches=0 is invalid: expected >= 1",
        ),
        ({"rl": {"save_checkpoint": False}}, r"\[rl\] save_checkpoint must be true"),
        ({"sft": {"batch_size": 0}}, r"\[sft\] option batch_size=0 is invalid: expected >= 1"),
        ({"sft": {"examples": -3}}, r"\[sft\] examples must be >= 0"),
        ({"model": {"lora_rank": -1}}, r"\[model\] lora_rank must be >= 0"),
        ({"model": {"dtype": "fp32"}}, r"\[model\] option dtype='fp32' is invalid"),
        ({"model": {"base_model": "tiny:gpt2:tiny"}}, r"'tiny:<arch>:<size>\[:<seed>\]'"),
        (
            {"model": {"base_model": "tiny:qwen2:tiny:x"}},
            r"the seed after the size must be an integer",
        ),
        ({"run": {"task": "revers"}}, r"\[run\] unknown task 'revers'; did you mean 'reverse'"),
        (
            {"run": {"backend": "rey"}},
            r"\[run\] unknown backend 'rey'; did you mean 'ray'\? \(known backends: local",
        ),
        ({"eval": {"held_out": 0}}, r"\[eval\] held_out must be >= 1"),
        ({"rl": 3}, r"\[rl\] must be a table"),
        ({"rl": {"steps": {"a": 1}}}, r"\[rl\] steps must be a value, got a table"),
        (
            {"model": {"lora_rank": 0, "train_mlp": False}},
            r"\[model\] train_mlp = false choose LoRA layers",
        ),
        (
            {"model": {"lora_rank": 4, **dict.fromkeys(LORA_LAYERS, False)}},
            r"\[model\] LoRA needs one of train_attn",
        ),
        ({"model": {"train_attn": "no"}}, r"train_attn='no' is invalid: expected bool"),
    ],
)
def test_bad_values_name_the_table_and_the_key(data, message):
    with pytest.raises(ValueError, match=message):
        parse_config(data)


def test_model_table_chooses_lora_layers():
    config = parse_config({"model": {"lora_rank": 4, "train_unembed": False}})
    assert (config.model.train_attn, config.model.train_mlp, config.model.train_unembed) == (
        True,
        True,
        False,
    )


def test_tiny_spec():
    assert parse_tiny_spec("tiny:qwen2:mini") == ("qwen2", "mini", None)
    assert parse_tiny_spec("tiny:llama:tiny:5") == ("llama", "tiny", 5)


def test_load_config_reads_toml_and_resolves_the_dataset_next_to_it(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[run]\ntask = "reverse"\n[sft]\ndataset = "chats.jsonl"\n[rl]\nsteps = 3\n')
    config = load_config(path)
    assert config.rl.steps == 3
    assert config.sft.enabled
    assert config.dataset_path() == tmp_path / "chats.jsonl"


def test_load_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[rl\nsteps = 3\n")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_config(bad)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_shipped_examples_load(path):
    config = load_config(path)
    # One example per task, named after it; a second real model's example on a task is named
    # after the model, then the task.
    assert path.stem in (config.run.task, f"gemma3-{config.run.task}")
    assert config.rl.steps > 0
    # A tiny model starts from random weights: RL needs the warm-up's format first. A real
    # (pretrained) one learns by RL alone.
    assert config.sft.enabled == config.model.base_model.startswith("tiny:")


def test_there_is_an_example_per_task():
    from posttrain.tasks import TASKS

    assert {p.stem for p in EXAMPLES} - {"gemma3-word-problems"} == set(TASKS)


def test_job_record_keeps_the_backend_table_and_a_resume_may_change_it():
    first = config_record(parse_config({"run": {"backend": "ray"}, "backend": {"num_workers": 2}}))
    assert first["backend"] == {"num_workers": 2} and first["run"]["backend"] == "ray"
    # Infrastructure may change between a run and its resume; the training settings may not.
    moved = config_record(parse_config({"run": {"backend": "ray"}, "backend": {"num_workers": 4}}))
    assert config_changes(first, moved) == []
    other = config_record(parse_config({"run": {"backend": "ray"}, "rl": {"learning_rate": 1.0}}))
    assert config_changes(first, other) == ["[rl] learning_rate: 1e-05 in the run, 1.0 now"]


def test_a_resume_compares_the_task_tables_and_tolerates_new_keys_at_their_default():
    first = config_record(parse_config({"run": {"task": "reverse"}, "task": {"max_length": 4}}))
    # A key posttrain added after the run started (max_bad_rollouts), left at its default: no
    # change; set away from it, a change.
    del first["rl"]["max_bad_rollouts"]
    same = config_record(parse_config({"run": {"task": "reverse"}, "task": {"max_length": 4}}))
    assert config_changes(first, same) == []
    tolerant = parse_config(
        {"run": {"task": "reverse"}, "task": {"max_length": 4}, "rl": {"max_bad_rollouts": 0.1}}
    )
    assert config_changes(first, config_record(tolerant)) == [
        "[rl] max_bad_rollouts: not in the run's job.json, 0.1 now"
    ]
    other = config_record(parse_config({"run": {"task": "reverse"}, "task": {"max_length": 5}}))
    assert config_changes(first, other) == ["[task] max_length: 4 in the run, 5 now"]
    without = config_record(parse_config({"run": {"task": "reverse"}}))
    assert config_changes(first, without) == [
        "[task]: in the run's job.json, not in the config now"
    ]
    data = config_record(parse_config({"data": {"train": "t.jsonl", "reward": "contains"}}))
    assert data["run"]["task"] == "data" and data["data"]["reward"] == "contains"
    exact = config_record(parse_config({"data": {"train": "t.jsonl"}}))
    assert config_changes(data, exact) == ["[data] reward: 'contains' in the run, 'exact' now"]


def test_lora_rank_zero_is_full_fine_tuning_in_toml_and_python():
    from posttrain.backends.model import TrainableModel

    assert parse_config({"model": {"lora_rank": 0}}).model.lora_rank == 0
    # The job passes [model] lora_rank as it is; TrainableModel reads 0 as None: one meaning.
    model = TrainableModel(name="m", project="p", base_model="b", lora_rank=0)
    assert model.lora_rank is None and model.config_dict()["lora_rank"] is None
    assert TrainableModel(name="m", project="p", base_model="b", lora_rank=4).lora_rank == 4
    with pytest.raises(ValueError, match="lora_rank must be >= 1 for LoRA, or 0 / None for full"):
        TrainableModel(name="m", project="p", base_model="b", lora_rank=-2)


def test_secrets_are_keys_whose_words_name_one():
    secret = ["api_key", "apiKey", "API_KEY", "hf_token", "authtoken", "client_secret", "password"]
    secret += ["db-password", "access.keys", "aws_credentials"]
    plain = ["micro_batch_tokens", "max_tokens", "num_workers", "base_url", "keep", "keyboard"]
    assert [k for k in secret if not is_secret(k)] == []
    assert [k for k in plain if is_secret(k)] == []


def test_job_json_never_holds_a_secret(tmp_path):
    config = parse_config(
        {
            "run": {"backend": "tinker"},
            "backend": {"api_key": "tml-SECRET-1", "hf_token": "hf-SECRET-2", "base_url": "u"},
        }
    )
    run_dir = prepare_run_dir(tmp_path / "run", config, resume=False)
    text = (run_dir / JOB_FILE).read_text()
    assert "SECRET" not in text
    # The keys stay, so one can see they were set; other values are kept as they are.
    assert json.loads(text)["backend"] == {"api_key": "***", "hf_token": "***", "base_url": "u"}
    # A resume with another key is the same run (where a run trains may change).
    rotated = parse_config({"run": {"backend": "tinker"}, "backend": {"api_key": "tml-NEW"}})
    assert prepare_run_dir(run_dir, rotated, resume=True) == run_dir


def test_rl_learning_rate_schedule():
    rl = parse_config({"rl": {"steps": 3, "learning_rate": 1e-3, "lr_warmup_steps": 2}}).rl
    # Constant (the default): the warm-up (k + 1) / 2, then the peak; a warm-up longer than the
    # run is allowed and never ends.
    assert [rl.learning_rate(k) for k in range(3)] == pytest.approx([5e-4, 1e-3, 1e-3])
    long = parse_config({"rl": {"steps": 2, "learning_rate": 1e-3, "lr_warmup_steps": 4}}).rl
    assert [long.learning_rate(k) for k in range(2)] == pytest.approx([2.5e-4, 5e-4])
    # Linear to 0 over 4 steps: 1 - k / 4.
    linear = parse_config({"rl": {"steps": 4, "learning_rate": 1e-3, "lr_schedule": "linear"}})
    rates = [linear.rl.learning_rate(k) for k in range(4)]
    assert rates == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])


@pytest.mark.parametrize(
    ("rl", "message"),
    [
        ({"lr_schedule": "cosin"}, "lr_schedule='cosin' is invalid.*did you mean 'cosine'"),
        ({"min_lr_ratio": 1.5}, r"\[rl\] min_lr_ratio must be in \[0, 1\], got 1.5"),
        (
            {"steps": 3, "lr_warmup_steps": 3, "lr_schedule": "cosine"},
            "lr_warmup_steps \\(3\\) leaves none of the 3 steps",
        ),
    ],
)
def test_rl_learning_rate_schedule_errors(rl, message):
    with pytest.raises(ValueError, match=message):
        parse_config({"rl": rl})


def test_overrides_set_keys_as_the_file_would():
    shipped = next(p for p in EXAMPLES if p.name == "reverse.toml")
    sets = ["rl.steps=2", "sft.epochs=1", "rl.learning_rate=1e-3", "run.name=short"]
    sets += ['model.base_model="tiny:qwen2:tiny"', "eval.held_out = 8"]
    config = load_config(shipped, sets)
    assert (config.rl.steps, config.sft.trainer.epochs, config.eval.held_out) == (2, 1, 8)
    assert config.rl.trainer.optimizer.learning_rate == 1e-3  # a TOML float
    assert (config.run.name, config.model.base_model) == ("short", "tiny:qwen2:tiny")
    # Every other key is the file's.
    plain = load_config(shipped)
    assert (config.rl.group_size, config.sft.examples) == (plain.rl.group_size, plain.sft.examples)
    assert load_config(shipped, ["inference.threads=1"]).inference.threads == 1  # a new table


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("rl.stepz=2", "[rl] unknown key 'stepz'; did you mean 'steps'?"),
        ("rl.steps=two", "[rl] option steps='two' is invalid: expected int"),
        ("rl.steps", "--set 'rl.steps': write TABLE.KEY=VALUE, e.g. --set rl.steps=2"),
        ("steps=2", "--set 'steps=2': write TABLE.KEY=VALUE"),
        ("rll.steps=2", "unknown table [rll]; did you mean 'rl'?"),
    ],
)
def test_a_bad_override_names_the_key_and_the_fix(override: str, error: str):
    shipped = next(p for p in EXAMPLES if p.name == "reverse.toml")
    with pytest.raises(ValueError) as raised:
        load_config(shipped, [override])
    assert error in str(raised.value)
