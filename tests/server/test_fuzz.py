"""Property-based fuzz of a real `posttrain serve` over its own OpenAPI spec: no request, however
hostile, gets a 5xx or loses its keep-alive connection.

Schemathesis draws requests for every operation of the spec. They are steered towards the ids
that exist (a live session and model, saved checkpoints) so that requests get past the lookups,
and then spoiled: a leaf of the body may become a hostile value (an integer past int64, a float
infinity, a lone surrogate, JSON nested past the parser's recursion limit). ForwardBackwardRequest
protobufs, which the spec cannot describe, are drawn from the wire schema directly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from serve_helpers import KEY, ServerProcess, post, result, start_server

from posttrain.server import proto_schema

schemathesis = pytest.importorskip("schemathesis")

# A server subprocess plus ~1,500 requests: about 30 s on 2 cores.
pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 40
PROTOBUF_EXAMPLES = 300
# Operations that end what the others use (the session, the model, the checkpoints): last.
DESTRUCTIVE = ("/finish", "/unload_model", "DELETE")
DEEP = "[" * 100_000 + "]" * 100_000
# asample options that posttrain serve refuses (400) unless left at these values.
UNSET = {
    "topk_prompt_logprobs": 0,
    "topk_sample_logprobs": 0,
    "prompt_alt_tokens_k": 0,
    "prompt_logprobs_last_n": None,
    "target_prompt_logprobs": None,
}
# Hypothesis leans to the simplest choice (the first, or 0): this leans the way meant.
MOSTLY = st.sampled_from([True, True, True, False])
# Hostile values by the type of the field they replace; object: for any other field.
HOSTILE_INTS: list[object] = [-1, 2**63, 2**64, -(2**63) - 1, 10**40]
HOSTILE_FLOATS: list[object] = [float("inf"), float("-inf"), float("nan"), 1e308, -1.0]
HOSTILE_STRINGS: list[object] = ["\ud800", "a\udfffb", "\x00", "../../etc/passwd"]
HOSTILE: dict[type, list[object]] = {
    int: HOSTILE_INTS,
    float: HOSTILE_FLOATS,
    str: HOSTILE_STRINGS,
    object: [*HOSTILE_INTS, *HOSTILE_FLOATS, *HOSTILE_STRINGS, None, True, [], {}],
}


@dataclass
class Tally:
    """What the fuzz sent, and what went wrong: a 5xx, a dropped connection, or a queued request
    whose future failed with category "server" (a 5xx in all but name)."""

    sent: int = 0
    failures: list[str] = field(default_factory=list)
    futures: dict[str, str] = field(default_factory=dict)  # request_id -> the request

    def check(self, what: str, send: Callable[[], httpx.Response]) -> None:
        self.sent += 1
        try:
            response = send()
        except httpx.TransportError as err:  # a dropped connection is a failure too
            self.failures.append(f"{what}: connection lost ({err!r})")
            return
        if response.status_code >= 500:
            self.failures.append(f"{what}: {response.status_code} {response.text[:200]}")
        elif response.status_code == 200 and "/retrieve_future" not in what:
            body = response.json()
            if isinstance(body, dict) and isinstance(body.get("request_id"), str):
                self.futures[body["request_id"]] = what

    def check_futures(self, client: httpx.Client) -> None:
        for request_id, what in self.futures.items():
            while True:  # pending futures end within the server's 1 s seq-gap timeout
                outcome = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
                if outcome.json().get("type") != "try_again":
                    break
            if outcome.json().get("category") == "server":
                self.failures.append(f"{what}: failed on the server: {outcome.json()['error']}")

    def report(self, what: str) -> str:
        return (
            f"fuzz: {self.sent} {what}, {len(self.futures)} of them queued; "
            f"{len(self.failures)} answered 5xx, dropped the connection or failed on the server"
        )


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    storage = tmp_path_factory.mktemp("serve-fuzz") / "storage"
    process = start_server(tiny_model_dir, storage, "--seq-gap-timeout", "1")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def known(server: ServerProcess, tiny_model_dir: Path) -> dict[str, str]:
    """Real ids for the fuzz to use: a live session and model, its checkpoints, a sampler."""
    session = post(server, "create_session", json={}).json()["session_id"]
    create = {"session_id": session, "model_seq_id": 0, "base_model": str(tiny_model_dir)}
    model = result(server, post(server, "create_model", json=create).json()["request_id"])
    model_id = model["model_id"]
    saves = {}
    for route, name in (("save_weights", "w"), ("save_weights_for_sampler", "s")):
        body = {"model_id": model_id, "seq_id": len(saves) + 1, "path": name}
        saves[route] = result(server, post(server, route, json=body).json()["request_id"])["path"]
    sampling = {
        "session_id": session,
        "sampling_session_seq_id": 0,
        "base_model": create["base_model"],
    }
    sampler = post(server, "create_sampling_session", json=sampling).json()["sampling_session_id"]
    return {
        "session_id": session,
        "model_id": model_id,
        "run_id": model_id,
        "base_model": str(tiny_model_dir),
        "model": str(tiny_model_dir),
        "name": str(tiny_model_dir),
        "path": saves["save_weights"],
        "tinker_path": saves["save_weights"],
        "model_path": saves["save_weights_for_sampler"],
        "sampling_session_id": sampler,
        "sampler_id": sampler,
        "checkpoint_id": "weights/w",
    }


def focused(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` with the counts of sampled sequences and tokens kept small (sampling runs for real,
    and the bounds themselves are tested elsewhere), and without undeclared fields, which the
    server ignores: the draws go to the fields it reads."""
    small = {"num_samples": 4, "n": 4, "max_tokens": 8, "max_completion_tokens": 8}

    def visit(node: object) -> None:
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                node.setdefault("additionalProperties", False)
                for name in set(props) & set(small):
                    props[name] = {"type": "integer", "minimum": 1, "maximum": small[name]}
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(spec)
    return spec


@st.composite
def steered(draw: st.DrawFn, value: object, known: Mapping[str, object]) -> object:
    """`value` with most fields named in `known` set to the real id, so that requests get past
    the lookups (random ids only ever meet a 404), and the options refused as unsupported mostly
    left out."""
    if isinstance(value, dict):
        return {
            key: {**known, **UNSET}[key]
            if key in {**known, **UNSET} and draw(MOSTLY)
            else draw(steered(child, known))
            for key, child in value.items()
        }
    if isinstance(value, list):
        return [draw(steered(child, known)) for child in value]
    return value


@st.composite
def spoiled(draw: st.DrawFn, value: object) -> object:
    """`value` as drawn, or with one field swapped for a hostile value of its own type (so that
    the rest of the request still gets past validation), or for JSON nested too deeply."""
    how = draw(st.sampled_from(["as drawn", "hostile field", "as drawn", "hostile field", "deep"]))
    paths = list(leaves(value, ()))[1:]  # never the whole body: that only meets a 422
    if how == "as drawn" or not paths:
        return value
    path = draw(st.sampled_from(paths))
    if how == "deep":
        return replace(value, path, "__DEEP__")
    old = get(value, path)
    kind = bool if isinstance(old, bool) else type(old)
    return replace(value, path, draw(st.sampled_from(HOSTILE.get(kind, HOSTILE[object]))))


def leaves(node: object, path: tuple[object, ...]) -> Iterator[tuple[object, ...]]:
    yield path
    if isinstance(node, dict):
        for key, child in node.items():
            yield from leaves(child, (*path, key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from leaves(child, (*path, i))


def get(node: Any, path: tuple[object, ...]) -> object:
    for part in path:
        node = node[part]
    return node


def replace(node: Any, path: tuple[object, ...], value: object) -> object:
    copy = dict(node) if isinstance(node, dict) else list(node)
    copy[path[0]] = value if len(path) == 1 else replace(node[path[0]], path[1:], value)  # pyright: ignore[reportCallIssue, reportArgumentType]
    return copy


def encode(body: object) -> bytes:
    # ensure_ascii escapes lone surrogates as \ud800, as a hostile client would send them.
    return json.dumps(body, allow_nan=True).replace('"__DEEP__"', DEEP).encode()


FUZZ_SETTINGS = settings(
    database=None,
    derandomize=True,  # the same requests on every run: CI fails only for a change in the code
    deadline=None,
    phases=[Phase.generate],  # failures are collected, not raised: nothing to shrink
    suppress_health_check=HealthCheck.all(),
)


def fuzz_operation(
    operation: Any, known: dict[str, str], client: httpx.Client, tally: Tally
) -> None:
    """Send EXAMPLES_PER_OPERATION drawn (and sometimes spoiled) requests of `operation`."""

    @settings(FUZZ_SETTINGS, max_examples=EXAMPLES_PER_OPERATION)
    @given(data=st.data())
    def send(data: st.DataObject) -> None:
        case = data.draw(operation.as_strategy())
        if case.path_parameters:
            case.path_parameters = data.draw(steered(case.path_parameters, known))
        query: Any = data.draw(steered(case.query, known)) if case.query else None
        body = None
        if isinstance(case.body, dict | list):
            body = data.draw(spoiled(data.draw(steered(case.body, known))))
        content = None if body is None else encode(body)
        headers = {"content-type": "application/json"} if content is not None else {}
        what = f"{case.method} {case.formatted_path} {(content or b'')[:300]!r}"
        tally.check(
            what,
            lambda: client.request(
                case.method, case.formatted_path, params=query, content=content, headers=headers
            ),
        )

    send()


def test_openapi_operations_never_answer_5xx(
    server: ServerProcess, known: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    headers = {"X-API-Key": KEY}
    spec = httpx.get(f"{server.url}/openapi.json", headers=headers).json()
    schema = schemathesis.openapi.from_dict(focused(spec))
    operations = [op.ok() for op in schema.get_all_operations()]
    operations.sort(key=lambda op: any(d in f"{op.method.upper()} {op.path}" for d in DESTRUCTIVE))
    tally = Tally()
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        for operation in operations:
            fuzz_operation(operation, known, client, tally)
        tally.check_futures(client)
    with capsys.disabled():
        print(f"\n{tally.report(f'requests over {len(operations)} operations')}")
    assert not tally.failures, "\n".join(tally.failures[:20])


TOKENS = st.integers(0, 259) | st.integers(-(2**31), 2**31 - 1)  # the tiny vocabulary, or any


@st.composite
def tensors(draw: st.DrawFn, message: Any, length: int) -> None:
    """Fill a Tensor message: usually one value per position, as the loss expects, else not."""
    message.dtype = draw(st.sampled_from([2, 1, 3, 4, 0, 99]))  # int64, float32, ... unknown
    shape = draw(
        st.sampled_from([[length], [length], [], [length, 2], [length + 1], [-1], [2**40]])
    )
    message.shape.extend(shape)
    size = max(1, int(np.prod(shape))) if all(0 <= n < 64 for n in shape) else 3
    if message.dtype == 2:
        message.dense = np.asarray(
            draw(st.lists(TOKENS, min_size=size, max_size=size)), "<i8"
        ).tobytes()
    else:
        values = st.floats(width=32, allow_nan=True, allow_infinity=True)
        message.dense = np.asarray(
            draw(st.lists(values, min_size=size, max_size=size)), "<f4"
        ).tobytes()


@st.composite
def forward_backward_bodies(draw: st.DrawFn, model_id: str) -> tuple[bytes, str | None]:
    """A ForwardBackwardRequest (body, Content-Encoding): mostly well formed, for the real model,
    with token ids and tensors that may be anything the wire allows."""
    msg = proto_schema.new_message("ForwardBackwardRequest")
    msg.model_id = draw(st.sampled_from([model_id, model_id, model_id, "", "session-x:train:0"]))
    msg.seq_id = draw(st.integers(-(2**31), 2**31 - 1))
    msg.loss_fn = draw(st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "", "x"]))
    msg.forward_only = draw(st.booleans())
    for key in draw(st.lists(st.sampled_from(["clip_low_threshold", "beta", ""]), max_size=2)):
        msg.loss_fn_config_v2[key].number = draw(st.floats())
    for _ in range(draw(st.integers(0, 3))):
        datum = msg.data.add()
        tokens = draw(st.lists(TOKENS, max_size=8))
        datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
        keys = st.sampled_from(["target_tokens", "weights", "advantages", "logprobs", ""])
        for key in draw(st.lists(keys, unique=True, max_size=3)):
            draw(tensors(datum.loss_fn_inputs[key], len(tokens)))
    body = msg.SerializeToString()
    if draw(st.sampled_from([False, False, True])):
        body = draw(spoiled_bytes(body))
    encoding = draw(st.sampled_from([None, None, "zstd", "gzip"]))
    if encoding == "zstd":
        import zstandard

        body = zstandard.ZstdCompressor().compress(body)
    return body, encoding


@st.composite
def spoiled_bytes(draw: st.DrawFn, body: bytes) -> bytes:
    """`body` cut short, or with a few bytes overwritten."""
    if not body or draw(st.booleans()):
        return body[: draw(st.integers(0, len(body)))]
    at = draw(st.integers(0, len(body) - 1))
    return body[:at] + draw(st.binary(min_size=1, max_size=4)) + body[at + 4 :]


def test_forward_backward_protobufs_never_answer_5xx(
    server: ServerProcess, known: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    tally = Tally()
    headers = {"X-API-Key": KEY, "content-type": "application/x-protobuf"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:

        @settings(FUZZ_SETTINGS, max_examples=PROTOBUF_EXAMPLES)
        @given(drawn=forward_backward_bodies(known["model_id"]))
        def send(drawn: tuple[bytes, str | None]) -> None:
            body, encoding = drawn
            extra = {"content-encoding": encoding} if encoding else {}
            tally.check(
                f"forward_backward ({encoding}) {body[:200]!r}",
                lambda: client.post("/api/v1/forward_backward", content=body, headers=extra),
            )

        send()
    with httpx.Client(base_url=server.url, headers={"X-API-Key": KEY}, timeout=60) as client:
        tally.check_futures(client)
    with capsys.disabled():
        print(f"\n{tally.report('forward_backward protobufs')}")
    assert not tally.failures, "\n".join(tally.failures[:20])
