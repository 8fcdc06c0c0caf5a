"""The `posttrain train` job: build or load a model, SFT warm-up, then RL on a task or an
environment.

Phases: optional SFT warm-up (one `train_sft` call), optional DPO on `[dpo] data` (one
`train_dpo` call), greedy held-out evaluation, RL steps
(`prompts_per_step` x `group_size` samples in one batched call, or as many multi-turn
episodes of an environment, rewards, `backend.train`, `model.log`), evaluation again.
Everything lives in the run directory `<output_dir>/<project>/models/<name>/`: checkpoints,
`history.jsonl`, `metrics.jsonl`, `curve.png`, `job.json`, and an LLM judge's score cache
`judge_cache.sqlite`. What differs between a task and an
environment is in `jobs.work`.

Resume is exact: the prompts (or environment seeds) and the sampling seed of RL step k derive
from (seed, k) alone, so the only data cursor is the number of steps done (`JobState`, in
`model.run_state`), saved with every checkpoint together with weights, optimizer and RNG. Each
step is trained, logged, then checkpointed; resuming drops the log rows of steps after the
checkpoint and redoes them.

With `[rl] max_off_policy_steps = N > 0` the rollouts of the next N steps are sampled while a
step trains (`jobs.pipeline`), and each RL row also has `stale_trajectories`, `max_staleness`
and the engine's `policy_version` after the step. Resume then restores the weights, optimizer,
RNG, step counter and data cursor exactly, but not the rollouts in flight at the kill: they are
sampled again from the restored weights, so the continuation is not bit-identical to an
uninterrupted run.

Every RL step, synchronous or not, records in its metrics row and its `history.jsonl` row
where its time went (`time/*`), the engine sync's bytes and version (`sync/*`), how stale its
tokens were (`staleness/*`) and tokens per second (`throughput/*`):
`jobs.pipeline.pipeline_metrics`. `posttrain report` sums them over a run.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

from posttrain.backends.model import TrainableModel
from posttrain.backends.options import RLOptions, SFTOptions
from posttrain.backends.plugins.registry import BackendInfo
from posttrain.backends.protocol import CheckpointsOnDemand, TrainableBackend
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.environments.resolve import ResolvedEnvironment
from posttrain.inference.model_sampler import ModelSampler
from posttrain.jobs.backend import (
    JobPreflightError,
    call_options,
    create_backend,
    job_problems,
    work_problems,
)
from posttrain.jobs.config import DataConfig, JobConfig, load_config
from posttrain.jobs.pipeline import TrainedStep, rl_steps, trainable_tokens
from posttrain.jobs.report import MetricsLog, plot_curves, progress_line, rewind_history
from posttrain.jobs.run_dir import JobState, locate_run, prepare_run_dir, resolve_base_model
from posttrain.jobs.tables import DPOJobConfig
from posttrain.jobs.teacher import build_teacher
from posttrain.jobs.work import JobWork, job_work
from posttrain.rollouts.dpo_data import load_preference_pairs
from posttrain.rollouts.sft_data import SFTFields, load_sft_dataset
from posttrain.rollouts.task_rollouts import SampledStep
from posttrain.tasks.judge import Judge
from posttrain.trainer.config import option_defaults, option_values, with_options
from posttrain.trainer.progress import INTERVAL_S, duration, report_progress

JUDGE_CACHE = "judge_cache.sqlite"  # in the run directory: an LLM judge's scores


@dataclass(frozen=True)
class JobResult:
    """Where the run is and how it went."""

    run_dir: Path
    accuracy_before: float  # held-out greedy accuracy before RL (after any warm-up)
    accuracy_after: float
    metrics_path: Path
    plot_path: Path
    seconds: float  # wall time of this call


@dataclass
class _Run:
    config: JobConfig
    work: JobWork  # the task or environment
    model: TrainableModel
    backend: TrainableBackend
    info: BackendInfo  # the backend's capabilities and the options it declares
    sampler: ModelSampler
    metrics: MetricsLog
    echo: Callable[[str], None]
    start: float
    rl_began: tuple[float, int] = (0.0, 0)  # (when, steps done then): this run's RL rate

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def rl_eta(self, done: int, steps: int) -> float:
        """Seconds left for the RL steps after `done`, at this run's pace (evaluations too)."""
        began, first = self.rl_began
        return (time.perf_counter() - began) / max(done - first, 1) * (steps - done)


def train(
    config_path: str | Path, *, resume: str | Path | None = None, resume_step: int | None = None
) -> JobResult:
    """Run the job in a TOML file (blocking); `resume` is a run directory to continue, from
    its latest checkpoint or from the checkpoint of model step `resume_step`."""
    return asyncio.run(run_job(load_config(config_path), resume=resume, resume_step=resume_step))


async def run_job(
    config: JobConfig,
    *,
    resume: str | Path | None = None,
    resume_step: int | None = None,
    on_step: Callable[[int], None] | None = None,
    echo: Callable[[str], None] = print,
    progress_bar: bool | None = None,
    progress_interval_s: float = INTERVAL_S,
) -> JobResult:
    """Run (or, with `resume`, continue) a job; `on_step(k)` is called after RL step k.

    A resume starts from the run's latest checkpoint, or from model step `resume_step`'s
    (`TrainableModel.register`: a damaged latest checkpoint is an error that offers it).

    Long loops inside a phase (the SFT warm-up's updates) show a bar on a terminal
    (`progress_bar=None`: when stderr is one), else a line through `echo` every
    `progress_interval_s`, each with a rate and an ETA; each RL step prints a line with its ETA.
    """
    start = time.perf_counter()
    if resume_step is not None and resume is None:
        raise ValueError("resume_step (--resume-step) continues a run: give its directory too")
    backend_path, project, name = locate_run(config, resume)
    found, problems = job_problems(config, resume=resume is not None, path=backend_path)
    resolved, more = work_problems(config)
    problems += more
    if problems or found is None or resolved is None:
        raise JobPreflightError(problems)  # before any work: nothing is written for such a job
    is_environment = isinstance(resolved, ResolvedEnvironment)
    run_dir = prepare_run_dir(
        backend_path / project / "models" / name,
        config,
        resume=resume is not None,
        task=None if is_environment else resolved.record(),
        environment=resolved.record() if is_environment else None,
    )
    cache = getattr(getattr(resolved, "task", None), "reward_source", None)
    if isinstance(cache, Judge):  # a resumed run asks its judge nothing it asked before
        cache.use_cache(run_dir / JUDGE_CACHE)
    base = resolve_base_model(config.model.base_model, run_dir)
    model = TrainableModel(
        name=name,
        project=project,
        base_model=str(base),
        lora_rank=config.model.lora_rank,  # 0: full fine-tuning, as TrainableModel takes it
        lora_alpha=config.model.lora_alpha,
        dtype=config.model.dtype,
        train_attn=config.model.train_attn,
        train_mlp=config.model.train_mlp,
        train_unembed=config.model.train_unembed,
        seed=config.run.seed,
    )
    backend = create_backend(found)
    try:
        await model.register(backend, resume_step=resume_step)
        if config.teacher is not None:
            teacher = await asyncio.to_thread(
                build_teacher, config.teacher, run_dir, seed=config.run.seed
            )
            echo(f"teacher: {teacher.name}")
            trainer = with_options(config.rl.trainer, teacher=teacher)
            config = replace(config, rl=replace(config.rl, trainer=trainer))
        run = _Run(
            config=config,
            work=job_work(config, resolved, model),
            model=model,
            backend=backend,
            info=found.info,
            sampler=backend.sampling_client(model),
            metrics=MetricsLog(run_dir / "metrics.jsonl"),
            echo=echo,
            start=start,
        )
        with report_progress(echo, bar=progress_bar, interval_s=progress_interval_s):
            return await _run_phases(run, on_step)
    finally:
        await backend.close()


async def _run_phases(run: _Run, on_step: Callable[[int], None] | None) -> JobResult:
    config = run.config
    state = JobState.load(run.model.run_state)
    done = state.rl_steps_done
    run.echo(f"run directory: {run.model.directory}")
    if done:
        run.echo(f"resuming after RL step {done}/{config.rl.steps} (model step {run.model.step})")
    run.metrics.rewind(done, sft_done=state.sft_done, dpo_done=state.dpo_done)
    rewind_history(run.model.directory / "history.jsonl", run.model.step)
    if config.sft.enabled and not state.sft_done:
        await _warm_up(run, state)
    if config.dpo is not None and not state.dpo_done:
        await _dpo_phase(run, state)
    if state.accuracy_before is None:
        state.accuracy_before = await _evaluate(run, 0, "before RL")
        state.save(run.model.run_state)  # goes with the next checkpoint
    elif done and done < config.rl.steps and config.eval.every and done % config.eval.every == 0:
        await _evaluate(run, done, f"after step {done}")
    before = state.accuracy_before
    run.rl_began = (time.perf_counter(), done)
    await _rl_phase(run, state, done, on_step)
    after = await _evaluate(run, config.rl.steps, "after RL")
    title = f"{run.work.name}: {config.run.project}/{config.run.name}"
    plot = plot_curves(run.metrics.rows(), run.model.directory / "curve.png", title)
    n, unit = run.work.held_out, run.work.unit
    run.echo(
        f"held-out accuracy ({n} {unit}, greedy): before RL {before:.1%} -> after RL "
        f"{after:.1%} ({(after - before) * 100:+.1f} points)"
    )
    run.echo(f"plot: {plot}")
    return JobResult(
        run_dir=run.model.directory,
        accuracy_before=before,
        accuracy_after=after,
        metrics_path=run.metrics.path,
        plot_path=plot,
        seconds=run.elapsed(),
    )


async def _warm_up(run: _Run, state: JobState) -> None:
    """One `train_sft` call on task solutions (or environment demonstrations) and/or the
    configured dataset."""
    config, tokenizer = run.config, run.sampler.tokenizer
    examples: list[Trajectory] = []
    if config.sft.examples:
        examples += await run.work.sft_examples(tokenizer)
    dataset = config.dataset_path()
    if dataset is not None:
        examples += load_sft_dataset(dataset, tokenizer, fields=sft_fields(config.data))
    run.echo(f"sft warm-up: {len(examples)} examples, {config.sft.trainer.epochs} epochs")
    began = time.perf_counter()
    options = cast(SFTOptions, call_options(config.sft.trainer, run.info.train_sft_options))
    state.sft_done = True
    state.save(run.model.run_state)
    if "save_checkpoint" in options:  # only where declared: else the backend's default holds
        options["save_checkpoint"] = not _checkpoints_on_demand(run)
    result = await run.backend.train_sft(run.model, examples, **options)
    seconds = time.perf_counter() - began
    loss = result.metrics["loss"]  # train_sft always makes at least one update
    metrics = {**result.metrics, "examples": float(len(examples)), "step_s": seconds}
    await run.model.log(split="train", metrics=metrics, step=result.step)
    run.metrics.write("sft", result.step, {"loss": loss, "step_s": seconds})
    await _checkpoint(run)
    updates = int(result.metrics["num_updates"])
    run.echo(f"sft warm-up done in {seconds:.1f}s: {updates} updates, mean loss {loss:.4f}")


async def _dpo_phase(run: _Run, state: JobState) -> None:
    """One `train_dpo` call on `[dpo] data`, with the `[dpo]` options set or written
    (`dpo_options`)."""
    path, dpo = run.config.dpo_path(), run.config.dpo
    assert path is not None and dpo is not None
    train_dpo = getattr(run.backend, "train_dpo", None)
    if train_dpo is None:
        raise TypeError(
            f"[dpo] needs a backend with train_dpo; {type(run.backend).__name__} has none"
        )
    pairs = load_preference_pairs(path, run.sampler.tokenizer)
    run.echo(f"dpo: {len(pairs)} pairs, {dpo.trainer.epochs} epochs, loss={dpo.trainer.loss_fn}")
    options = dpo_options(dpo)
    options["save_checkpoint"] = not _checkpoints_on_demand(run)
    state.dpo_done = True
    state.save(run.model.run_state)
    began = time.perf_counter()
    result = await train_dpo(run.model, pairs, **options)
    seconds = time.perf_counter() - began
    await run.model.log(
        split="train", metrics={**result.metrics, "step_s": seconds}, step=result.step
    )
    keys = ("loss", "rewards/accuracy", "rewards/margin")
    run.metrics.write(
        "dpo", result.step, {**{k: result.metrics[k] for k in keys}, "step_s": seconds}
    )
    await _checkpoint(run)
    run.echo(
        f"dpo done in {seconds:.1f}s: loss {result.metrics['loss']:.4f}, reward accuracy "
        f"{result.metrics['rewards/accuracy']:.1%}, margin {result.metrics['rewards/margin']:.3f}"
    )


def dpo_options(dpo: DPOJobConfig) -> dict[str, object]:
    """The train_dpo options of `[dpo]`: those set away from their default and those the table
    writes (preflight refused any the backend lacks), so no value written is dropped."""
    defaults = option_defaults(type(dpo.trainer))
    values = option_values(dpo.trainer).items()
    return {k: v for k, v in values if v != defaults[k] or k in dpo.written}


def _checkpoints_on_demand(run: _Run) -> bool:
    """Whether the job can log a step before checkpointing it (see `_checkpoint`)."""
    return isinstance(run.backend, CheckpointsOnDemand)


async def _checkpoint(run: _Run) -> None:
    """Make the step just trained and logged durable, with the job's state.

    Logging first, then checkpointing, makes resume exact: a crash before the checkpoint redoes
    the whole step, and `MetricsLog.rewind`/`rewind_history` drop its rows. A backend that only
    checkpoints inside `train` (a plugin) checkpoints before the logs instead, so a crash right
    after its checkpoint loses that step's log rows.
    """
    if isinstance(run.backend, CheckpointsOnDemand):
        await run.backend.checkpoint(run.model)


async def _rl_phase(
    run: _Run, state: JobState, done: int, on_step: Callable[[int], None] | None
) -> None:
    """RL steps `done..steps-1` through the public loop (`jobs.pipeline.rl_steps`), each
    sampling then training, or, with `[rl] max_off_policy_steps` N > 0, training while the
    next N steps' rollouts are sampled; around each step, only the job's own: its data
    cursor, logs, checkpoint and evaluation."""
    config = run.config
    ahead = config.rl.max_off_policy_steps
    sampled: dict[int, SampledStep] = {}  # each step's bad rollouts and reward costs

    async def sample(k: int) -> list[TrajectoryGroup]:
        sampled[k] = await run.work.sample(run.sampler, k)
        return sampled[k].groups

    def options(k: int) -> RLOptions:
        trainer = with_options(config.rl.trainer, learning_rate=config.rl.learning_rate(k))
        chosen = cast(RLOptions, call_options(trainer, run.info.train_options))
        if "save_checkpoint" in chosen:  # only where declared: else the backend's default
            chosen["save_checkpoint"] = not _checkpoints_on_demand(run)
        state.rl_steps_done = k + 1  # saved with the step's checkpoint
        state.save(run.model.run_state)
        return chosen

    steps = rl_steps(
        run.backend,
        run.model,
        sample,
        steps=config.rl.steps,
        start=done,
        max_off_policy_steps=ahead,
        options=options,
    )
    async with aclosing(steps) as trained_steps:  # rollouts in flight are not saved: a
        async for trained in trained_steps:  # resume resamples them
            await _log_step(run, trained, sampled.pop(trained.step), asynchronous=ahead > 0)
            k = trained.step
            if on_step is not None:
                on_step(k + 1)
            if config.eval.every and (k + 1) % config.eval.every == 0 and k + 1 < config.rl.steps:
                await _evaluate(run, k + 1, f"after step {k + 1}")


async def _log_step(
    run: _Run, trained: TrainedStep, step: SampledStep, *, asynchronous: bool
) -> None:
    """Log RL step `trained.step` (its `step` of rollouts, stale ones left out), write its
    metrics row, checkpoint; asynchronous RL's rows also say how stale it was and the
    engine's policy version after the step."""
    config = run.config.rl
    logged_at = time.perf_counter()
    k, result, pipeline = trained.step, trained.result, dict(trained.metrics)
    bad = {"bad_rollouts": float(step.bad_rollouts), **step.metrics}  # + a judge's costs
    metrics = {**result.metrics, **bad, **pipeline}
    logged = await run.model.log(list(trained.groups), metrics=metrics, step=result.step)
    sampled, sample_s = float(trainable_tokens(trained.groups)), pipeline["time/sample_s"]
    row = {
        "reward": logged["reward"],
        "accuracy": logged["accuracy"],
        # No loss when every group had zero reward variance: nothing was trained this step.
        "loss": result.metrics.get("loss", math.nan),
        "learning_rate": config.learning_rate(k),
        **bad,
        "sampled_tokens": sampled,
        "sample_tokens_per_s": sampled / sample_s if sample_s > 0 else 0.0,
        **pipeline,
    }
    if asynchronous:
        row["stale_trajectories"] = float(trained.stale_trajectories)
        row["max_staleness"] = float(trained.max_staleness)
        version = run.sampler.policy_version
        if version is not None:
            row["policy_version"] = float(version)
    # Sampling, training and logging; not the checkpoint.
    step_s = pipeline["time/step_s"] + time.perf_counter() - logged_at
    row.update(tokens_per_s=sampled / step_s, step_s=step_s, elapsed_s=run.elapsed())
    run.metrics.write("rl", k + 1, row)
    await _checkpoint(run)
    run.echo(progress_line(k + 1, config.steps, row, eta_s=run.rl_eta(k + 1, config.steps)))


async def _evaluate(run: _Run, rl_step: int, label: str) -> float:
    """Greedy held-out accuracy, logged as a `val` row and an `eval` metrics row."""
    began = time.perf_counter()
    result = await run.work.evaluate(run.sampler)
    seconds = time.perf_counter() - began
    await run.model.log(split="val", metrics={**result.metrics, "rl_step": float(rl_step)})
    run.metrics.write("eval", rl_step, {**result.metrics, "elapsed_s": run.elapsed()})
    n, unit = run.work.held_out, run.work.unit
    run.echo(
        f"held-out accuracy {label}: {result.accuracy:.1%} ({n} {unit}, greedy, "
        f"{duration(seconds)}, {n / max(seconds, 1e-9):.1f} {unit}/s)"
    )
    return result.accuracy


def sft_fields(data: DataConfig | None) -> SFTFields:
    """How the job reads `[sft] dataset` lines: with its `[data]` table's field names, if any."""
    if data is None:
        return SFTFields()
    return SFTFields(
        messages=data.messages_field or "messages",
        prompt=data.prompt_field or "prompt",
        answer=data.answer_field,
        system_prompt=data.system_prompt,
    )
