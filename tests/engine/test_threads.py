"""Thread settings (usable cores, cgroup quotas, the environment's request, the report) and the
`ComputeThread` that runs calls one at a time on one thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from posttrain.cli.thread_report import ThreadReport, thread_report
from posttrain.clients.futures import OrderedRunner
from posttrain.engine.compute_thread import ComputeThread
from posttrain.engine.threads import (
    cgroup_cpu_quota,
    chosen_threads,
    configure_torch_threads,
    requested_threads,
    usable_cores,
)


@pytest.fixture(autouse=True)
def no_thread_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No request from the environment, and torch's count restored after each test."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("POSTTRAIN_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def cgroup(tmp_path: Path, **files: str) -> Path:
    """A fake cgroup root: `cpu_max` -> cpu.max, `quota`/`period` -> v1's cpu/ files."""
    names = {
        "cpu_max": "cpu.max",
        "quota": "cpu/cpu.cfs_quota_us",
        "period": "cpu/cpu.cfs_period_us",
    }
    for key, text in files.items():
        path = tmp_path / names[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu_max": "200000 100000"}, 2.0),  # docker --cpus=2 under cgroup v2
        ({"cpu_max": "150000 100000"}, 1.5),
        ({"cpu_max": "max 100000"}, None),  # no limit
        ({"cpu_max": "lots 100000"}, None),  # unreadable: treated as no limit
        ({"quota": "50000", "period": "100000"}, 0.5),  # cgroup v1
        ({"quota": "-1", "period": "100000"}, None),  # v1's "no limit"
        ({}, None),
    ],
)
def test_cgroup_cpu_quota(tmp_path: Path, files: dict[str, str], quota: float | None) -> None:
    assert cgroup_cpu_quota(cgroup(tmp_path, **files)) == quota


def test_usable_cores_take_the_smallest_limit(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path) == min(affinity, os.cpu_count() or 1)  # no quota here
    # 1.5 cores round down to 1 thread; 0.5 core still gets 1.
    assert usable_cores(cgroup(tmp_path / "a", cpu_max="150000 100000")) == 1
    assert usable_cores(cgroup(tmp_path / "b", cpu_max="50000 100000")) == 1
    roomy = cgroup(tmp_path / "c", cpu_max=f"{100000 * (affinity + 8)} 100000")
    assert usable_cores(roomy) == min(affinity, os.cpu_count() or 1)


def test_the_environment_request(monkeypatch: pytest.MonkeyPatch) -> None:
    assert requested_threads() == (None, "")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert requested_threads() == (3, "OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # one count per nesting level: torch's first
    assert requested_threads() == (4, "OMP_NUM_THREADS")
    monkeypatch.setenv("POSTTRAIN_NUM_THREADS", "1")  # posttrain's own variable wins
    assert requested_threads() == (1, "POSTTRAIN_NUM_THREADS")


@pytest.mark.parametrize(
    ("value", "problem"), [("two", "is not a whole number"), ("0", "at least 1")]
)
def test_a_bad_request_names_the_variable_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, value: str, problem: str
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ValueError, match=problem) as err:
        requested_threads()
    assert f"OMP_NUM_THREADS={value!r}" in str(err.value)
    assert f"OMP_NUM_THREADS={usable_cores()}" in str(err.value) and "unset it" in str(err.value)
    report = thread_report()  # the report says what is wrong instead of raising
    assert report.chosen is None and report.warnings()[0] == str(err.value)


def test_configure_sets_torch_to_the_request_else_the_usable_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert configure_torch_threads() == usable_cores() == torch.get_num_threads()
    monkeypatch.setenv("POSTTRAIN_NUM_THREADS", "1")
    assert configure_torch_threads() == 1 == torch.get_num_threads()
    seen: list[int] = []  # threads started later inherit the count
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen == [1]


def test_a_tiny_model_computes_on_one_thread_unless_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Below hidden size 128 a second thread costs more than it saves (engine.threads).
    assert chosen_threads(64) == 1 == configure_torch_threads(64) == torch.get_num_threads()
    assert chosen_threads(127) == 1
    assert chosen_threads(128) == chosen_threads(896) == chosen_threads() == usable_cores()
    assert thread_report(64).chosen == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # an explicit request wins
    assert chosen_threads(64) == 3 == thread_report(64).chosen


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_configuring_two_threads_parks_an_openmp_pool_on_the_calling_thread() -> None:
    # A fresh interpreter: this one's main thread may have started its pool already.
    script = (
        "import os, torch\n"
        "from posttrain.engine.threads import configure_torch_threads\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "configure_torch_threads()\n"
        "print(len(os.listdir('/proc/self/task')) - before)\n"
    )
    env = {**os.environ, "POSTTRAIN_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"  # the pool of 2: the calling thread and one parked worker


def test_report_warnings() -> None:
    fine = ThreadReport(2, 2, 2, None, "", 0.5)
    assert fine.warnings() == []
    assert fine.describe().startswith("posttrain computes with 2 torch thread(s) on 2 usable")
    asked = ThreadReport(8, 8, 2, 8, "OMP_NUM_THREADS", 0.5).warnings()
    assert len(asked) == 1 and "OMP_NUM_THREADS=8 asks for more threads than the 2" in asked[0]
    assert "set OMP_NUM_THREADS=2" in asked[0]
    default = ThreadReport(8, 2, 2, None, "", None).warnings()
    assert len(default) == 1 and "torch defaults to 8 threads on 2 usable" in default[0]
    busy = ThreadReport(2, 2, 2, None, "", 3.5).warnings()
    assert len(busy) == 1 and "load average is 3.5 on 2 usable core(s)" in busy[0]
    assert "start with OMP_WAIT_POLICY=PASSIVE" in busy[0]
    assert ThreadReport(1, 1, 2, None, "", 3.5).warnings() == []  # no OpenMP pool to wait on
    passive = ThreadReport(2, 2, 2, None, "", 3.5, wait_policy="passive")
    assert "OMP_WAIT_POLICY" not in passive.warnings()[0]  # already set: not advised again
    assert "OpenMP waits: OMP_WAIT_POLICY=passive" in passive.describe()


def test_compute_thread_runs_every_call_on_one_thread_in_order() -> None:
    compute = ComputeThread("test-compute")
    ran: list[tuple[int, int]] = []
    gate = threading.Event()
    compute.submit(gate.wait)  # holds the thread until every submitter has queued its calls

    def submitter(n: int) -> list[object]:
        return [compute.submit(lambda i=i: ran.append((n, i))) for i in range(20)]

    futures: list[object] = []
    threads = [threading.Thread(target=lambda n=n: futures.extend(submitter(n))) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gate.set()
    assert compute.call(threading.get_ident) == compute.ident != threading.get_ident()
    # Every submitter's calls ran, each in the order it submitted them.
    for n in range(4):
        assert [i for m, i in ran if m == n] == list(range(20))
    compute.close()


def test_a_call_from_the_compute_thread_itself_runs_inline() -> None:
    compute = ComputeThread("test-compute")
    # Queued behind its caller, the inner call would never run and `result()` would hang.
    inner = compute.call(lambda: compute.submit(threading.get_ident).result(timeout=5))
    assert inner == compute.ident

    def fails() -> None:
        raise ValueError("bad token id")

    with pytest.raises(ValueError, match="bad token id"):
        compute.call(lambda: compute.call(fails))
    compute.close()


def test_runners_sharing_a_thread() -> None:
    compute = ComputeThread("test-compute")
    first, second = OrderedRunner("a", compute), OrderedRunner("b", compute)
    gate = threading.Event()
    held = first.submit(gate.wait)
    later = second.submit(threading.get_ident)
    closing = threading.Thread(target=first.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive()  # close() waits for the runner's own call in flight
    gate.set()
    closing.join(5)
    assert not closing.is_alive() and held.done()
    # The shared thread goes on for the other runner; the closed one takes no more calls.
    assert later.result(timeout=5) == compute.ident
    assert second.submit(lambda: 7).result(timeout=5) == 7
    with pytest.raises(RuntimeError, match="closed"):
        first.submit(lambda: 1)
    second.close()
    compute.close()


def test_the_command_line_sets_threads_before_computing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from posttrain.cli.main import main

    torch.set_num_threads(2)
    monkeypatch.setenv("POSTTRAIN_NUM_THREADS", "1")
    assert main(["make-tiny-model", str(tmp_path / "model")]) == 0
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("POSTTRAIN_NUM_THREADS", "two")
    assert main(["make-tiny-model", str(tmp_path / "other")]) == 2
    assert "POSTTRAIN_NUM_THREADS='two' is not a whole number" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()  # refused before any work


def test_serve_reads_the_hidden_size_that_chooses_its_threads(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from posttrain.server.config import model_config_int

    assert model_config_int(str(tiny_model_dir), "hidden_size") == 64  # the tiny model: one thread
    assert model_config_int(str(tmp_path), "hidden_size") is None  # no config: the usable cores
