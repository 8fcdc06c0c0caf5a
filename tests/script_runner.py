"""One Python for many short runs of a script or of the `posttrain` command.

The tests that run every benchmark (test_benchmarks.py) and every `posttrain` command of the
docs (test_docs.py) spent most of each run importing torch, transformers and PEFT: about 8 s
of CPU on a 2-core machine, for runs that then work for one or two seconds. A `ScriptRunner`
is one subprocess that imports them once and then does each run as `python SCRIPT ARGS` or
`python -m MODULE ARGS` would (runpy, `__name__ == "__main__"`, the script's folder first on
sys.path), in the run's own working directory and environment, its file descriptors 1 and 2
sent to files (so its own subprocesses' output is captured too).

Between runs it puts back the working directory, the environment, sys.argv, sys.path, torch's
thread count, warning filters, logging handlers and signal handlers. A run that leaves a
thread or a child process behind (a server it did not stop) fails, since it would run into the
next. A run that overruns its timeout kills the runner (and what it started); the next run
starts a new one.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]


@dataclass(frozen=True)
class Completed:
    """What a run left: its exit code and output, as `subprocess.run` gives them."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


class ScriptRunner:
    """Runs `python ARGS` in one long-lived interpreter (see the module docstring)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._env = env
        self._process: subprocess.Popen[str] | None = None
        self._outputs = Path(tempfile.mkdtemp(prefix="script-runner-"))
        self._count = 0

    def run(self, args: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> Completed:
        """`python *args` in `cwd` with `env`: a script, or "-m" and a module, after any
        "-W ACTION:MESSAGE:CATEGORY:MODULE" options."""
        process = self._started()
        self._count += 1
        out = self._outputs / f"{self._count}.out"
        err = self._outputs / f"{self._count}.err"
        request = {"args": args, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)}
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        try:
            line = _read_line(process, timeout)
        except TimeoutError:
            self.close()
            raise TimeoutError(
                f"python {' '.join(args)} did not finish within {timeout} s"
            ) from None
        if not line:
            code = process.wait()
            self._process = None
            raise RuntimeError(
                f"the script runner died (exit code {code}) running python {' '.join(args)}: "
                + (err.read_text()[-3000:] if err.exists() else "")
            )
        answer = json.loads(line)
        leftovers = answer["leftovers"]
        stderr = err.read_text()
        if leftovers:
            stderr += f"\nscript runner: the run left {leftovers} running"
        code = answer["returncode"] if not leftovers else answer["returncode"] or 1
        return Completed(args, code, out.read_text(), stderr)

    def close(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
            self._process = None

    def _started(self) -> subprocess.Popen[str]:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, __file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=self._env,
                start_new_session=True,  # close() kills what a run started too
            )
        return self._process


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise TimeoutError
    return process.stdout.readline()


# The runner's side: this file run as a script.


def _serve() -> None:
    import peft  # noqa: F401  # the imports every run shares: the point of the runner
    import torch
    import transformers  # noqa: F401

    import posttrain.cli.main  # noqa: F401

    answers = os.fdopen(os.dup(1), "w")  # fds 1 and 2 belong to the runs from here on
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    threads = torch.get_num_threads()
    for line in sys.stdin:
        request = json.loads(line)
        saved = (os.getcwd(), dict(os.environ), list(sys.argv), list(sys.path))
        handlers, level = list(logging.root.handlers), logging.root.level
        signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        before = {t.ident for t in threading.enumerate()}
        with warnings.catch_warnings():  # a run's warning filters end with it
            code = _run(request)
        leftovers = _leftover_threads(before)
        leftovers += [f"process {pid}" for pid in _children()]
        os.chdir(saved[0])
        os.environ.clear()
        os.environ.update(saved[1])
        sys.argv[:], sys.path[:] = saved[2], saved[3]
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
        for number, handler in signals.items():
            signal.signal(number, handler)
        torch.set_num_threads(threads)
        answers.write(json.dumps({"returncode": code, "leftovers": leftovers}) + "\n")
        answers.flush()


def _run(request: dict[str, Any]) -> int:
    args = [str(a) for a in request["args"]]
    while args[0] == "-W":
        _warning_option(args[1])
        args = args[2:]
    out = os.open(str(request["out"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(str(request["err"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    kept = os.dup(1), os.dup(2)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    code = 0
    try:
        os.chdir(str(request["cwd"]))
        os.environ.clear()
        os.environ.update(request["env"])
        if args[0] == "-m":
            sys.argv[:] = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv[:] = args
            sys.path.insert(0, str(Path(args[0]).resolve().parent))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(kept[0], 1)
        os.dup2(kept[1], 2)
        os.close(kept[0])
        os.close(kept[1])
    return code


def _leftover_threads(before: set[int | None]) -> list[str]:
    """The run's threads still alive once what it left is collected: a pool's idle worker
    (a client nobody closed, as a script may leave it at exit) ends with its pool, within a
    few seconds. Daemon threads (tqdm's monitor) never keep a process alive; they are not
    counted."""
    import gc

    gc.collect()
    started = [t for t in threading.enumerate() if t.ident not in before and not t.daemon]
    deadline = time.monotonic() + 5.0
    for thread in started:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return [t.name for t in started if t.is_alive()]


def _warning_option(spec: str) -> None:
    """Python's -W option (ACTION:MESSAGE:CATEGORY:MODULE:LINENO, as the interpreter reads it)."""
    import builtins
    import re

    action, message, category, module, lineno = (spec.split(":") + [""] * 5)[:5]
    warnings.filterwarnings(
        action,  # pyright: ignore[reportArgumentType]  # checked by filterwarnings
        message=re.escape(message),
        category=getattr(builtins, category) if category else Warning,
        module=re.escape(module) + r"\Z" if module else "",
        lineno=int(lineno or 0),
    )


def _children() -> list[int]:
    """This process's live child processes (Linux: /proc), reaping any that have exited."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    me = str(os.getpid())
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                children.append(int(entry.name))
    return children


if __name__ == "__main__":
    _serve()
