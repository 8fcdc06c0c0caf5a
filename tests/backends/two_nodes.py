"""A two-node Ray cluster on this machine, for the tests of RayBackend across nodes.

Each node is a `ray start --block` process with its own temp dir, one CPU and one `worker_slot`,
a custom resource: two workers that need a slot each can only land one per node. The head
takes the address Ray picks for this machine and the second node 127.0.0.2 (another loopback
address), so a driver in this process attaches to the head.

Ray's token authentication is on for the nodes exactly when it is for this process
(`auth_mode`).

Where this process may make a mount namespace (root, or an unprivileged user namespace), the
second node runs in one of its own in which a tmpfs covers `private/`: the same path names
different files on the two nodes, as a node's local disk does. `shared/` is the same directory
on both, as network storage is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import psutil

import posttrain

SLOT = "worker_slot"
SECOND_IP = "127.0.0.2"
RAY = Path(sys.executable).with_name("ray")
# `ray start` runs its node's processes until it gets SIGTERM, then stops them (Ray's own
# shutdown hook); the wait is generous for a loaded two-core machine.
STOP_WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def auth_mode() -> str:
    """Ray's token authentication setting for the nodes: this process's, else "disabled".

    A driver given an explicit address turns token authentication on only when RAY_AUTH_MODE
    says so (as a local ray.init earlier in this process does), while a head turns it on by
    itself when it finds ~/.ray/auth_token (which any local ray.init on this machine writes)
    and a joining node never does: stated explicitly, all three agree.
    """
    return os.environ.get("RAY_AUTH_MODE") or "disabled"


def private_mount_prefix() -> list[str] | None:
    """The `unshare` command that gives a process its own mounts, or None where it cannot."""
    if shutil.which("unshare") is None:
        return None
    prefix = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "-Urm"]
    probe = subprocess.run(
        [*prefix, "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True, timeout=30
    )
    return prefix if probe.returncode == 0 else None


class TwoNodeCluster:
    """Start with `start()`, stop with `stop()`; `address` is the head's GCS address."""

    def __init__(self) -> None:
        # Ray's socket paths must stay short: a temp dir under the system's, not pytest's.
        self.base = Path(tempfile.mkdtemp(prefix="pt-2n-"))
        self.shared = self.base / "shared"
        self.private = self.base / "private"
        for directory in (self.shared, self.private):
            directory.mkdir()
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.private_disk = False  # whether `private/` differs between the nodes

    def start(self) -> None:
        env = {
            **os.environ,
            # The workers import posttrain from this checkout, as the driver does.
            "PYTHONPATH": str(Path(posttrain.__file__).parents[1]),
            "RAY_USAGE_STATS_ENABLED": "0",
            "OMP_NUM_THREADS": "1",
            "RAY_AUTH_MODE": auth_mode(),
        }
        head = [
            "--head",
            f"--port={self.port}",
            f"--ray-client-server-port={free_port()}",
            "--include-dashboard=false",
        ]
        self._node("head", head, env, prefix=[])
        self._wait_for_head()
        prefix = private_mount_prefix()
        self.private_disk = prefix is not None
        if prefix is not None:
            # Mount a tmpfs over private/ in the node's own namespace, then become `ray start`.
            prefix = [*prefix, "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', self.private]
        second = [f"--address={self.address}", f"--node-ip-address={SECOND_IP}"]
        self._node("second", second, env, prefix or [])

    def _node(self, name: str, extra: list[str], env: dict[str, str], prefix: list[object]) -> None:
        temp = self.base / f"ray-{name}"
        command = [
            *map(str, prefix),
            str(RAY),
            "start",
            "--block",
            *extra,
            "--num-cpus=1",
            "--num-gpus=0",
            f"--resources={json.dumps({SLOT: 1})}",
            f"--temp-dir={temp}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            "--disable-usage-stats",
        ]
        log = (self.base / f"{name}.log").open("wb")
        self.processes.append(
            subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        )

    def _wait_for_head(self, within_s: float = 60.0) -> None:
        """Until the head's GCS accepts connections (a driver connecting earlier retries and
        logs a warning per try)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.processes[0].poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"the head did not start: {self.logs()}")

    def wait_for_nodes(self, ray: ModuleType, within_s: float = 120.0) -> tuple[str, str]:
        """The node ids of the head and the second node, once both are alive (`ray` is this
        process's, connected to the cluster)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            alive = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
            if len(alive) == 2 and SECOND_IP in alive:
                second = alive.pop(SECOND_IP)
                return alive.popitem()[1], second
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"a ray start exited early: {self.logs()}")
            time.sleep(0.5)
        raise TimeoutError(f"the two nodes did not come up in {within_s} s: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-2000:] for p in self.base.glob("*.log"))

    def stop(self) -> None:
        """SIGTERM each `ray start` (it stops its node's processes), then make sure they did."""
        descendants: list[psutil.Process] = []
        for process in self.processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                descendants += psutil.Process(process.pid).children(recursive=True)
        for process in reversed(self.processes):
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        _, left = psutil.wait_procs(descendants, timeout=STOP_WAIT_S)
        for process in left:  # only what these `ray start` commands started
            process.kill()
        shutil.rmtree(self.base, ignore_errors=True)
