"""The Ray session posttrain's executors run in: a local Ray on loopback, or a joined cluster.

With no address, a local Ray is started on 127.0.0.1 with usage stats and the dashboard off,
so nothing listens beyond loopback or reports home. It is shared by every executor of this
process and shut down when the last one is closed. A Ray session the caller started is used
as it is and never shut down here. Joining a cluster that uses Ray's token authentication
needs Ray's own settings in the environment (`RAY_AUTH_MODE=token` and the cluster's token).
"""

from __future__ import annotations

import math
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

RAY_EXTRA_HINT = "Ray is not installed: pip install 'posttrain[ray]'"

_lock = threading.Lock()
_users = 0  # executors (and ray_session blocks) holding the session posttrain started


def import_ray() -> ModuleType:
    """Ray, imported on first use, with an error naming the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(RAY_EXTRA_HINT) from exc
    return ray


def loopback_interface() -> str | None:
    """The loopback network interface name ("lo" on Linux, "lo0" on macOS), if any."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), None)


def acquire_ray(address: str | None = None, num_cpus: float | None = None) -> bool:
    """Make sure this process has a Ray session; returns True if it is a loopback-only one.

    `address=None` starts a local Ray sized to at least `num_cpus` CPUs; any other address
    ("auto", or the head's "host:port") joins that cluster. A session this process already
    has is reused, whatever `address` says.
    """
    ray = import_ray()
    global _users
    with _lock:
        if ray.is_initialized():
            if _users > 0:
                _users += 1
            return _is_loopback(ray)
        if address is None:
            # Must be set before the first start; a user's explicit choice wins.
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            cpus = max(os.cpu_count() or 1, math.ceil(num_cpus or 0))
            with _single_node_addressing(ray):
                ray.init(
                    address="local",  # never silently join a cluster found on this machine
                    num_cpus=cpus,
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    namespace="posttrain",
                    configure_logging=False,
                )
        else:
            ray.init(address=address, namespace="posttrain", configure_logging=False)
        _users = 1
        return _is_loopback(ray)


def release_ray() -> None:
    """Drop one hold on the session; the last hold shuts down a session started here."""
    ray = import_ray()
    global _users
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users == 0 and ray.is_initialized():
            ray.shutdown()


@contextmanager
def ray_session(address: str | None = None, num_cpus: float | None = None) -> Iterator[None]:
    """Hold one Ray session across several executors (tests and benchmarks share one start)."""
    acquire_ray(address, num_cpus)
    try:
        yield
    finally:
        release_ray()


@contextmanager
def _single_node_addressing(ray: ModuleType) -> Iterator[None]:
    """Keep 127.0.0.1 as the node address while a local Ray starts.

    On Linux Ray replaces 127.0.0.1 by the machine's routable address (and its servers then
    listen on every interface) unless it believes it runs single-node, as it does on macOS.
    Flipping that belief during `ray.init` makes every Ray server bind to loopback.
    """
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    if constants is None or not hasattr(constants, "ENABLE_RAY_CLUSTER"):
        yield  # a Ray without the switch: it binds where it binds
        return
    saved = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved


def _is_loopback(ray: ModuleType) -> bool:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return bool(nodes) and all(n.get("NodeManagerAddress") == "127.0.0.1" for n in nodes)
