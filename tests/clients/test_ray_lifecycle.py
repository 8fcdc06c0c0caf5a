"""The local Ray a RayTrainingClient starts by itself: loopback only, no usage stats, and
nothing left behind after close() or after an interpreter exit without it.

No shared Ray here: each test needs this process (or a child) to start its own. Processes
this test session started before (a shared `posttrain serve`) are not Ray's and not counted.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import psutil
import pytest
from ray_helpers import wait_until_gone

from posttrain.clients.create import create_training_client
from posttrain.engine.ray.actor import store_directory
from posttrain.engine.ray.executor import RayConfig
from posttrain.engine.ray.session import import_ray

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("without_shared_ray")]


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or IPv4 loopback mapped into IPv6 (::ffff:127.0.0.1)."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def listening_addresses(processes: list[psutil.Process]) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every socket these processes listen on."""
    out: set[tuple[str, str, int]] = set()
    for process in processes:
        try:
            connections = process.net_connections(kind="inet")
            name = process.name()
        except psutil.NoSuchProcess:
            continue
        for conn in connections:
            if conn.status == psutil.CONN_LISTEN:
                out.add((name, conn.laddr.ip, conn.laddr.port))
    return out


def test_own_ray_listens_on_loopback_only_and_close_frees_it(tiny_model_dir, tmp_path):
    ray = import_ray()
    assert not ray.is_initialized(), "another test left a Ray session up in this process"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    client = create_training_client(
        tiny_model_dir,
        storage_dir=tmp_path,
        executor="ray",
        num_workers=2,
        ray_config=RayConfig(startup_timeout_s=180.0),
        lora_rank=None,
    )
    from ray._common.usage import usage_lib

    try:
        # Read back from Ray's runtime: its control store and its one node are on loopback ...
        assert ray.get_runtime_context().gcs_address.rsplit(":", 1)[0] == "127.0.0.1"
        nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
        assert nodes == ["127.0.0.1"]
        # Usage stats off as seen by this driver, and by the head when it started: the cluster
        # metadata it stored in the control store has the usage-only fields only when on.
        assert not usage_lib.usage_stats_enabled()
        metadata = usage_lib.get_cluster_metadata(ray._private.worker.global_worker.gcs_client)
        assert "ray_version" in metadata and "session_start_timestamp_ms" not in metadata
        # ... and so is every socket its processes (servers and actors) listen on.
        processes = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        listening = listening_addresses(processes)
        assert listening, "found no listening Ray process: the check would prove nothing"
        assert {(n, ip, port) for n, ip, port in listening if not is_loopback(ip)} == set()
        actors = client.executor.pids()
        assert set(actors) <= {p.pid for p in processes}
        store = store_directory(client.executor.rendezvous)
        assert store is not None and store.is_dir()
    finally:
        client.close()
    assert not ray.is_initialized()  # the Ray it started is shut down
    assert wait_until_gone(actors + [p.pid for p in processes])
    assert not store.exists()


EXIT_WITHOUT_CLOSE = """
import json, sys
import psutil
from posttrain.clients.create import create_training_client
client = create_training_client(sys.argv[1], storage_dir=sys.argv[2], executor="ray", num_workers=2)
print(json.dumps({
    "actors": client.executor.pids(),
    "ray": [p.pid for p in psutil.Process().children(recursive=True)],
    "rendezvous": client.executor.rendezvous,
}), flush=True)
"""


def test_an_exit_without_close_leaves_no_ray_process_behind(tiny_model_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tiny_model_dir), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(seen["actors"]) == 2 and set(seen["actors"]) <= set(seen["ray"])
    assert wait_until_gone(seen["actors"] + seen["ray"]), "Ray processes outlived their driver"
    store = store_directory(seen["rendezvous"])
    assert store is not None and not store.exists()
