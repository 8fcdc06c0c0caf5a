"""Peak memory of a dataset task on a large file: Parquet (kept in datasets' memory-mapped Arrow
table, problems built when drawn) against the same rows as JSONL (parsed into Python dicts).

It writes ROWS rows of {"prompt", "answer"} as Parquet and as JSONL, then, for each format in a
fresh process with one thread, builds `DatasetTask.from_file` (every row checked, the hash
split) and draws `--steps` steps of `--prompts` problems plus one evaluation's held-out
problems, as a job does. It prints the process's peak RSS (ru_maxrss) and its rise over the
level after imports, and the resident anonymous (heap) and file-backed (mapped file) memory
at the end (/proc/self/status). The Parquet run includes datasets' one-time conversion into a
fresh cache directory. The machine may be shared: the times are approximate; the memory is not.

    python benchmarks/dataset_memory.py [--rows 1000000] [--steps 5] [--prompts 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from host import host_line


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def resident_mb() -> dict[str, float]:
    """RssAnon and RssFile of this process (Linux), in MiB; empty elsewhere."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return {}
    fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
    return {
        key: int(fields[key].split()[0]) / 1024 for key in ("RssAnon", "RssFile") if key in fields
    }


def write_files(directory: Path, rows: int) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = [f"What is {i} + {i % 97}? Answer with the number only." for i in range(rows)]
    answers = [str(i + i % 97) for i in range(rows)]
    parquet, jsonl = directory / "problems.parquet", directory / "problems.jsonl"
    pq.write_table(pa.table({"prompt": prompts, "answer": answers}), parquet)
    with jsonl.open("w") as f:
        for prompt, answer in zip(prompts, answers, strict=True):
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    return {"parquet": parquet, "jsonl": jsonl}


def measure(path: Path, steps: int, prompts: int) -> dict[str, float]:
    """Build the task from `path` and draw as a job does, in this process."""
    import pyarrow as pa

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    import datasets  # imported by both runs, so that their baselines match  # noqa: F401

    from posttrain.tasks.dataset import DatasetTask

    base = peak_rss_mb()
    began = time.perf_counter()
    task = DatasetTask.from_file(path)
    built = time.perf_counter() - began
    rng = random.Random(0)
    drawn = [task.make_prompts(rng, prompts) for _ in range(steps)]
    held = task.held_out(0, 100)
    assert all(len(d) == prompts for d in drawn)
    assert len(held) == min(100, len(task.held_out_problems))
    return {
        "rows": len(task.train) + len(task.held_out_problems),
        "build_s": built,
        "peak_mb": peak_rss_mb(),
        "rise_mb": peak_rss_mb() - base,
        **{f"{k}_mb": v for k, v in resident_mb().items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64, help="problems drawn per step")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(Path(args.child), args.steps, args.prompts)))
        return
    print(host_line(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(Path(tmp), args.rows)
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(Path(tmp) / "cache"))
        print(f"{args.rows} rows; {args.steps} steps x {args.prompts} problems, 100 held out")
        for name, path in files.items():
            size = path.stat().st_size / 2**20
            command = [sys.executable, __file__, "--child", str(path)]
            command += ["--steps", str(args.steps), "--prompts", str(args.prompts)]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            anon, mapped = result.get("RssAnon_mb", 0.0), result.get("RssFile_mb", 0.0)
            print(
                f"{name:8s} file {size:6.1f} MiB  peak RSS {result['peak_mb']:7.1f} MiB "
                f"(+{result['rise_mb']:6.1f} over imports)  at the end: heap {anon:7.1f} MiB, "
                f"mapped files {mapped:6.1f} MiB  build {result['build_s']:.1f} s"
            )


if __name__ == "__main__":
    main()
