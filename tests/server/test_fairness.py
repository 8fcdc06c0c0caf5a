"""Fair turns between tenants through a real `posttrain serve` and the official tinker SDK.

Four sessions (ServiceClients) sample the base model at once. One floods: it submits 24
`sample_async` requests at once. The other three keep two requests in flight each, submitting a
new one as each finishes (two, so that an HTTP round trip between one result and the next
request never leaves them without one waiting). Every request is the same (prompt, 64 samples
of 16 tokens, seed), so each costs the same compute.

Concurrent sample requests run in shared batches (`server.sample_batching`) of at most 128 rows,
so two of these requests fill one: the batches are what is scarce, and the server fills them
round-robin across sessions. Each session's share of the completed requests is then its share
of the compute. The server records each future's completion time and sampling session in its
SQLite store; the window is from the first completion to the flood's last. First in, first out,
the flood would take most of the window (the compute thread's FIFO measured 91%, 4.5%, 4.5%,
0% before batching); fair, each session gets about 25% (measured: 27.6%, 24.1%, 24.1%,
24.1% of 87 requests).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import KEY, OTHER_KEY, ServerProcess

from posttrain.server.sample_batching import MAX_ROWS
from posttrain.server.store import ModelRow, SamplerRow, Store

tinker = pytest.importorskip("tinker")
types = tinker.types


PROMPT = [10, 72, 101, 108, 108, 111]
FLOOD = 24
SAMPLES = MAX_ROWS // 2  # rows per request: two requests fill a batch


def test_a_requests_tenant_is_its_session_else_its_owner(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    lora: dict[str, int | bool] = {"rank": 4}
    store.add_model(ModelRow("s1:train:0", "alice", "s1", "tiny", lora, {}, 0.0, 0.0))
    store.add_sampler(SamplerRow("sampler-1", "alice", "s2", "tiny", None, None, None))
    store.add_sampler(SamplerRow("sampler-2", "alice", None, "tiny", None, None, None))
    for request_id, model_id in [
        ("train", "s1:train:0"),  # a training client's request: its session
        ("sample", "sampler-1"),  # a sampling client's: its session
        ("loose", "sampler-2"),  # a sampler outside any session: its owner
        ("create", "s1:train:1"),  # a model still loading has no row yet: its owner
        ("none", None),
    ]:
        store.add_future(request_id, "alice", "x", "hash", model_id=model_id)
    tenants = {r: store.tenant(r) for r in ("train", "sample", "loose", "create", "none", "?")}
    assert tenants == {
        "train": "s1",
        "sample": "s2",
        "loose": "owner:alice",
        "create": "owner:alice",
        "none": "owner:alice",
        "?": None,
    }


# 24 + about 72 requests of 64 x 16 tokens on the tiny model: several seconds on a busy CPU.
@pytest.mark.slow
def test_a_flooding_session_does_not_starve_three_steady_ones(
    server: ServerProcess, tiny_model_dir: Path
) -> None:
    services = [
        tinker.ServiceClient(base_url=server.url, api_key=key)
        for key in (KEY, OTHER_KEY, KEY, OTHER_KEY)
    ]
    samplers = [s.create_sampling_client(base_model=str(tiny_model_dir)).result() for s in services]
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=16, seed=0, temperature=1.0)
    samplers[0].sample(prompt, 1, params).result()  # the base sampler is loaded before timing
    start = time.time()
    stop = threading.Event()
    errors: list[BaseException] = []

    def steady(sampler: Any) -> None:
        try:
            in_flight = [sampler.sample(prompt, SAMPLES, params) for _ in range(2)]
            while not stop.is_set():
                in_flight.pop(0).result()
                in_flight.append(sampler.sample(prompt, SAMPLES, params))
            for future in in_flight:
                future.result()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=steady, args=(s,)) for s in samplers[1:]]
    for thread in threads:
        thread.start()
    flood = [samplers[0].sample(prompt, SAMPLES, params) for _ in range(FLOOD)]
    for future in flood:
        future.result()
    stop.set()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    ids = [str(s._sampling_session_id) for s in samplers]  # the SDK's own record of them
    rows = [(t, sid) for t, sid in completions(server) if sid in ids and t > start]
    # The window: every completion up to the flood's last one.
    last_flood = max(t for t, sid in rows if sid == ids[0])
    window = Counter(sid for t, sid in rows if t <= last_flood)
    shares = {ids.index(sid): n / sum(window.values()) for sid, n in window.items()}
    assert len(shares) == 4, shares
    assert min(shares.values()) >= 0.2, shares
    for service in services:
        service.close("success").result()


def completions(server: ServerProcess) -> list[tuple[float, str]]:
    """(completed time, sampling session id) of every sample request, oldest first."""
    db = sqlite3.connect(f"file:{server.storage / 'state.db'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT completed, model_id FROM futures WHERE request_type='sample' "
            "AND status='completed' ORDER BY completed"
        ).fetchall()
    finally:
        db.close()
    return [(float(t), str(sid)) for t, sid in rows]
