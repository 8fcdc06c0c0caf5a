"""Mixed concurrent traffic on `posttrain serve`, as a new user would send it, and what the
one-compute-thread server must keep: no OpenMP spin, a fast first sample.

`--clients` users (default 8; threads, each with its own official tinker SDK ServiceClient and
LoRA training client on the tiny model) each run `--ops` operations (default 50), cycling
through forward_backward, optim_step, forward, sample and retrieve, each waited for before the
next (`.result()`). The first four are the SDK's compute calls; sample draws from the base
model. "Retrieve" is the REST client's `get_training_run`: a read of the user's run from the
server that computes nothing. Why that one: `retrieve_future` is how the SDK fetches every
other operation's result, so each of the four already includes it, and `get_info` is answered
from the SDK's cache without a request. Prints:

1. mixed: operations/s over all users (from the common start to the last finish) and each
   operation's median latency;
2. first sample: the latency of a second user's first sample after the server started, while
   the first user trains (forward_backward + optim_step back to back);
3. OpenMP spin: the server's CPU seconds (utime + stime of all its threads, /proc/PID/stat)
   per second over `--spin-seconds` with no request (0: nothing spins while it waits), and per
   second of one user sampling alone (at most 1 when one thread works; up to the thread count
   when OpenMP threads spin between operations); then that user's sampling tokens/s while one
   busy process per server thread keeps the cores busy, and as a fraction of its rate without
   them (spinning threads wait for descheduled ones: the case the one compute thread fixed).

With `--baseline-src DIR` (the `src` of another checkout, e.g. a worktree of an older commit),
every measurement also runs against a server started from DIR, alternating with this
checkout's server round by round, and the ratios (this / baseline) are printed.

The server's torch gets `--threads` threads (OMP_NUM_THREADS; by default it is unset, as a new
user leaves it, and each server prints what it chose).

    python benchmarks/serve_mixed.py [--size tiny] [--clients 8] [--ops 50] [--rounds 3]
        [--threads N] [--baseline-src DIR] [--spin-seconds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import tinker
from host import host_line
from serve_process import KEY, serve_process
from serve_threads import Sampler, first_requests, rate, sft_batch
from tinker import types

from posttrain.engine.threads import usable_cores
from posttrain.models.tiny import tiny_model_path

OPS = ("forward_backward", "optim_step", "forward", "sample", "retrieve")


class User:
    """One user: a LoRA training client, a sampling client of the base model and a REST
    client; `op(name)` runs one operation and waits for its result."""

    def __init__(self, url: str, base_model: str, args: argparse.Namespace) -> None:
        self.service = tinker.ServiceClient(base_url=url, api_key=KEY)
        self.training = self.service.create_lora_training_client(
            base_model=base_model, rank=8
        ).result()
        self.sampling = self.service.create_sampling_client(base_model=base_model).result()
        self.rest = tinker.RestClient(base_url=url, api_key=KEY)
        self.run_id = self.training.get_info().model_id
        self.data = sft_batch(args)
        self.prompt = types.ModelInput.from_ints(list(range(10, 34)))
        self.params = types.SamplingParams(max_tokens=args.new_tokens, seed=1)
        self.samples = args.samples

    def op(self, name: str) -> None:
        if name == "forward_backward":
            self.training.forward_backward(self.data, "cross_entropy").result()
        elif name == "optim_step":
            self.training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        elif name == "forward":
            self.training.forward(self.data, "cross_entropy").result()
        elif name == "sample":
            self.sampling.sample(self.prompt, self.samples, self.params).result()
        else:
            self.rest.get_training_run(self.run_id).result()


def mixed_round(users: list[User], ops: int) -> tuple[float, dict[str, list[float]]]:
    """Every user runs `ops` operations at once; operations/s and each operation's latencies."""
    latencies: dict[str, list[float]] = {name: [] for name in OPS}
    lock = threading.Lock()
    start = threading.Barrier(len(users) + 1)

    def work(user: User) -> None:
        start.wait()
        for i in range(ops):
            name = OPS[i % len(OPS)]
            began = time.perf_counter()
            user.op(name)
            with lock:
                latencies[name].append(time.perf_counter() - began)

    threads = [threading.Thread(target=work, args=(u,)) for u in users]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return len(users) * ops / (time.perf_counter() - began), latencies


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid` so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_during(pid: int, work: Callable[[], object]) -> tuple[float, float]:
    """The server's CPU seconds during `work()`, and its wall seconds."""
    cpu, wall = cpu_seconds(pid), time.perf_counter()
    work()
    return cpu_seconds(pid) - cpu, time.perf_counter() - wall


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """`count` processes that keep a core busy each (what other tenants of a machine do)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5)  # let them get going
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def spin(
    pid: int, sampler: Sampler, threads: int | None, args: argparse.Namespace
) -> dict[str, float]:
    """Idle CPU, CPU per second of sampling, and sampling with the cores kept busy."""
    seconds = args.spin_seconds
    idle, _ = cpu_during(pid, lambda: time.sleep(seconds))
    rates: list[float] = []
    cpu, wall = cpu_during(pid, lambda: rates.append(rate(sampler.request, seconds)))
    with busy_cores(threads or usable_cores()):
        busy = rate(sampler.request, seconds)
    return {
        "idle CPU s per s": idle / seconds,
        "sampling: server CPU s per s": cpu / wall,
        "sampling tokens/s, quiet cores": rates[0],
        "sampling tokens/s, busy cores": busy,
        "busy / quiet": busy / rates[0],
    }


class Server:
    """One `posttrain serve` under test, with its users, kept running across rounds."""

    def __init__(
        self, label: str, src: Path | None, threads: int | None, args: argparse.Namespace
    ) -> None:
        self.label, self.src, self.threads, self.args = label, src, threads, args
        self.base_model = str(tiny_model_path(size=args.size))
        self.results: dict[str, list[float]] = {}
        self.latencies: dict[str, list[float]] = {name: [] for name in OPS}
        self.stack = contextlib.ExitStack()

    def add(self, name: str, value: float) -> None:
        self.results.setdefault(name, []).append(value)

    def start(self, tmp: Path) -> None:
        """Start the server, time the first sample while a user trains, make the users."""
        self.log = tmp / self.label / "server.log"
        storage = tmp / self.label / "storage"
        storage.mkdir(parents=True)
        env = {"PYTHONPATH": str(self.src)} if self.src else None
        served = self.stack.enter_context(
            serve_process(Path(self.base_model), storage, self.threads, env=env)
        )
        url, self.pid = served.url, served.pid
        first = first_requests(url, self.base_model, self.args)
        self.add("first sample while another user trains (s)", first["sample"])
        self.users = [User(url, self.base_model, self.args) for _ in range(self.args.clients)]
        for user in self.users:  # warm-up: every operation once
            for name in OPS:
                user.op(name)
        self.sampler = Sampler(url, self.base_model, self.args)

    def round(self) -> None:
        ops_per_s, latencies = mixed_round(self.users, self.args.ops)
        self.add("mixed operations/s", ops_per_s)
        for name, values in latencies.items():
            self.latencies[name] += values
        for name, value in spin(self.pid, self.sampler, self.threads, self.args).items():
            self.add(name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description="Mixed concurrent traffic on the server.")
    parser.add_argument("--size", default="tiny", choices=("tiny", "mini", "small"))
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--ops", type=int, default=50, help="operations per client per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="default: unset")
    parser.add_argument("--baseline-src", type=Path, default=None)
    parser.add_argument("--baseline-threads", type=int, default=None, help="default: --threads")
    parser.add_argument("--spin-seconds", type=float, default=3.0)
    parser.add_argument("--samples", type=int, default=4, help="sequences per sample request")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4, help="sequences per forward(_backward)")
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    print(host_line(), flush=True)
    print(
        f"qwen2 {args.size} model, LoRA rank 8, fp32; {args.clients} users x {args.ops} "
        f"operations ({', '.join(OPS)}); forward(_backward) {args.batch} x {args.seq_len} "
        f"tokens, sample {args.samples} x up to {args.new_tokens} tokens; OMP_NUM_THREADS="
        f"{args.threads or 'unset'} (baseline: {args.baseline_threads or args.threads or 'unset'}) "
        f"on {usable_cores()} usable core(s)"
    )
    servers = [Server("this", None, args.threads, args)]
    if args.baseline_src is not None:
        threads = args.baseline_threads or args.threads
        servers.append(Server("baseline", args.baseline_src.resolve(), threads, args))
    loads = [os.getloadavg()[0]]
    with (
        tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        for server in servers:
            stack.enter_context(server.stack)
            server.start(Path(tmp))
        for i in range(args.rounds):
            # Alternate which server goes first, so neither always follows the other.
            for server in servers if i % 2 == 0 else servers[::-1]:
                server.round()
            loads.append(os.getloadavg()[0])
        for server in servers:  # read before the temporary directory goes
            for line in server.log.read_text().splitlines():
                if "threads: " in line:  # the server's own report of its settings
                    print(f"{server.label} server log:", line.split("threads: ", 1)[1])
    print(
        "load average (1 min) at start and after each round:", " ".join(f"{x:.1f}" for x in loads)
    )
    report(servers)


def report(servers: list[Server]) -> None:
    """Medians per server (over rounds; latencies over every operation), and ratios."""
    labels = [s.label for s in servers]
    head = " | ".join(f"{label:>10}" for label in labels)
    ratio = " | this / baseline" if len(servers) == 2 else ""
    print(f"{'':46} | {head}{ratio}")
    rows = [
        (name, [statistics.median(s.results[name]) for s in servers]) for name in servers[0].results
    ]
    rows += [
        (
            f"{name} median latency (ms)",
            [1000 * statistics.median(s.latencies[name]) for s in servers],
        )
        for name in OPS
    ]
    for name, values in rows:
        cells = " | ".join(f"{v:10.3g}" for v in values)
        extra = f" | {values[0] / values[1]:.2f}" if len(values) == 2 and values[1] else ""
        print(f"{name:46} | {cells}{extra}")


if __name__ == "__main__":
    main()
