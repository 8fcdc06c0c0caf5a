"""Protobuf codec of the Tinker wire protocol: forward_backward requests in, outputs and sample
responses out, in the bytes the `tinker` SDK 0.38 sends and decodes (spec sections 2 and 7).

Messages come from `proto_schema`, built with the protobuf runtime rather than a hand-written
wire codec: the runtime's parser checks wire types, lengths and UTF-8 for us, and the tensors
travel as opaque `bytes` fields that numpy reads directly, so the codec itself is only the
mapping between those messages and posttrain's types.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError

from posttrain.server import proto_schema as schema
from posttrain.types import (
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ModelInput,
    SampleResponse,
)

# A sparse tensor costs little on the wire but its dense form may not: refuse to densify one
# larger than this (256 MiB of float32), whatever the request body limit is.
MAX_DENSE_ELEMENTS = 1 << 26
# A zstd body may not inflate beyond this (the server passes its --max-body-mb instead).
MAX_DECOMPRESSED_BYTES = 1 << 30
# Decompressed in pieces of this size, so that a small body that claims (or inflates to) a huge
# size costs no more memory than the limit before it is refused.
_ZSTD_READ_BYTES = 1 << 20

_REQUEST_DTYPES = {schema.DTYPE_FLOAT32: np.dtype("<f4"), schema.DTYPE_INT64: np.dtype("<i8")}
_STOP_REASONS = {"stop": schema.STOP_REASON_STOP, "length": schema.STOP_REASON_LENGTH}


class ProtocolError(ValueError):
    """A request body that is not a well-formed protocol message; the text says what is wrong.

    `model_id` and `seq_id` are the message's, when it was read far enough to give them: the
    request is refused, but its `seq_id` still counts in the model's order.
    """

    def __init__(self, message: str, *, model_id: str | None = None, seq_id: int | None = None):
        super().__init__(message)
        self.model_id, self.seq_id = model_id, seq_id


class BodyTooLarge(ProtocolError):
    """A compressed body that inflates beyond the limit (answered 413)."""


@dataclass(frozen=True)
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool


def decode_forward_backward_request(
    body: bytes, content_encoding: str | None = None, max_bytes: int = MAX_DECOMPRESSED_BYTES
) -> ForwardBackwardRequest:
    """Decode a `POST /forward_backward` body (protobuf, optionally `Content-Encoding: zstd`,
    which may inflate to `max_bytes` at most)."""
    msg = schema.new_message("ForwardBackwardRequest")
    try:
        msg.ParseFromString(_decompress(body, content_encoding, max_bytes))
    except DecodeError as e:
        raise ProtocolError(f"body is not a valid ForwardBackwardRequest protobuf: {e}") from e
    if not msg.model_id:
        raise ProtocolError("ForwardBackwardRequest has no model_id")
    try:
        # Everything after the header is checked here, so that every refusal names the model
        # and seq_id it was for.
        if msg.seq_id < 0:
            raise ProtocolError(f"seq_id must be >= 0, got {msg.seq_id}")
        if not msg.loss_fn:
            raise ProtocolError("ForwardBackwardRequest has no loss_fn")
        return ForwardBackwardRequest(
            model_id=msg.model_id,
            seq_id=msg.seq_id,
            data=[_decode_datum(d, f"datum {i}") for i, d in enumerate(msg.data)],
            loss_fn=msg.loss_fn,
            loss_fn_config=_decode_loss_fn_config(msg),
            forward_only=msg.forward_only,
        )
    except ProtocolError as e:
        raise ProtocolError(str(e), model_id=msg.model_id, seq_id=msg.seq_id) from e


def _decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding != "zstd":
        raise ProtocolError(
            f"unsupported Content-Encoding {content_encoding!r}; send zstd or no encoding"
        )
    try:
        import zstandard
    except ImportError as e:
        raise ProtocolError(
            "body is zstd-compressed (Content-Encoding: zstd) but the server lacks the "
            "zstandard module; install it (pip install zstandard) or send uncompressed bodies"
        ) from e
    data = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True) as reader:
            # `read(n)` allocates n bytes up front: read small pieces, stop past the limit.
            while piece := reader.read(_ZSTD_READ_BYTES):
                data += piece
                if len(data) > max_bytes:
                    raise BodyTooLarge(
                        f"the zstd body inflates beyond the server's limit of {max_bytes} bytes "
                        "(--max-body-mb); send smaller requests"
                    )
    except zstandard.ZstdError as e:
        raise ProtocolError(f"body is not valid zstd data (Content-Encoding: zstd): {e}") from e
    return bytes(data)


def _decode_loss_fn_config(msg: Any) -> dict[str, float | str]:
    """`loss_fn_config_v2` (numbers and strings) over the legacy number-only `loss_fn_config`."""
    config: dict[str, float | str] = {key: float(v) for key, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise ProtocolError(f"loss_fn_config_v2[{key!r}] has neither number nor text")
        config[key] = float(value.number) if kind == "number" else value.text
    return config


def _decode_datum(msg: Any, where: str) -> Datum:
    inputs = {
        key: torch.from_numpy(_decode_tensor(tensor, f"{where}: loss_fn_inputs[{key!r}]"))
        for key, tensor in msg.loss_fn_inputs.items()
    }
    # Provenance spans (model_input_spans, loss_fn_input_spans) are accepted and not used.
    try:
        # The chunks too: EncodedTextChunk refuses a negative token id with a ValueError.
        chunks = tuple(
            _decode_chunk(c, f"model_input chunk {i}") for i, c in enumerate(msg.model_input)
        )
        return Datum(model_input=ModelInput(chunks=chunks), loss_fn_inputs=inputs)
    except ValueError as e:
        raise ProtocolError(f"{where}: {e}") from e


def _decode_chunk(msg: Any, where: str) -> EncodedTextChunk:
    kind = msg.WhichOneof("chunk")
    if kind == "encoded_text":
        tokens = _frombuffer(msg.encoded_text.tokens, np.dtype("<i4"), f"{where} tokens")
        return EncodedTextChunk(tokens=tuple(tokens.tolist()))
    if kind in ("image", "dmel"):
        raise ProtocolError(
            f"{where}: {kind} chunks are not supported; this server trains text models and "
            "accepts encoded_text chunks only"
        )
    raise ProtocolError(f"{where} is empty (no encoded_text, image or dmel)")


def _frombuffer(data: bytes, dtype: np.dtype[Any], where: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise ProtocolError(
            f"{where}: {len(data)} bytes is not a whole number of {dtype.itemsize}-byte values"
        )
    # A writable, native-order copy: torch.from_numpy shares it with the Datum.
    return np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("="))


def _decode_tensor(msg: Any, where: str) -> np.ndarray:
    dtype = _REQUEST_DTYPES.get(msg.dtype)
    if dtype is None:
        raise ProtocolError(
            f"{where}: dtype {schema.dtype_name(msg.dtype)} is not allowed in requests "
            "(DTYPE_FLOAT32 or DTYPE_INT64)"
        )
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise ProtocolError(f"{where}: negative dimension in shape {shape}")
    kind = msg.WhichOneof("encoding")
    if kind == "sparse_csr":
        return _densify_csr(msg.sparse_csr, dtype, shape, where)
    if kind is None:
        raise ProtocolError(f"{where}: tensor has neither dense nor sparse_csr data")
    values = _frombuffer(msg.dense, dtype, f"{where} dense")
    if not shape:
        return values
    if math.prod(shape) != values.size:
        raise ProtocolError(
            f"{where}: shape {shape} needs {math.prod(shape)} values, got {values.size}"
        )
    return values.reshape(shape)


def _densify_csr(csr: Any, dtype: np.dtype[Any], shape: list[int], where: str) -> np.ndarray:
    """Dense form of a CSR matrix; unlisted cells are 0 (the SDK's pad value)."""
    if len(shape) != 2:
        raise ProtocolError(f"{where}: a sparse_csr tensor needs a 2-D shape, got {shape}")
    rows, cols = shape
    if rows * cols > MAX_DENSE_ELEMENTS:
        raise ProtocolError(
            f"{where}: sparse_csr shape {shape} has {rows * cols} cells, over the limit of "
            f"{MAX_DENSE_ELEMENTS}"
        )
    values = _frombuffer(csr.values, dtype, f"{where} sparse_csr.values")
    crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), f"{where} sparse_csr.crow_indices")
    col = _frombuffer(csr.col_indices, np.dtype("<i8"), f"{where} sparse_csr.col_indices")
    counts = np.diff(crow)
    if crow.size != rows + 1 or crow[0] != 0 or (counts < 0).any() or crow[-1] != values.size:
        raise ProtocolError(
            f"{where}: sparse_csr.crow_indices must rise from 0 to the number of values "
            f"({values.size}) in {rows + 1} steps, got {crow.tolist()[:10]}"
        )
    if col.size != values.size or ((col < 0) | (col >= cols)).any():
        raise ProtocolError(
            f"{where}: sparse_csr.col_indices must give one column in [0, {cols}) per value"
        )
    cells = np.repeat(np.arange(rows, dtype=np.int64), counts) * cols + col
    if (np.diff(cells) <= 0).any():
        raise ProtocolError(f"{where}: sparse_csr columns must be increasing within each row")
    dense = np.zeros(rows * cols, dtype=values.dtype)
    dense[cells] = values
    return dense.reshape(rows, cols)


def encode_forward_backward_output(out: ForwardBackwardOutput) -> bytes:
    """A `ForwardBackwardOutput` protobuf: per-datum tensors batched per field, plus metrics.

    Datums are grouped into one ArrayRecord per run of equal trailing shapes (one record in the
    usual case); every datum must have the same output names.
    """
    for key in out.metrics:
        if key.count(":") != 1:
            raise ValueError(f"metric key {key!r} must be '<name>:<reduction>' (one colon)")
    msg = schema.new_message("ForwardBackwardOutput")
    msg.loss_fn_output_type = out.loss_fn_output_type
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    arrays = [{k: _output_array(k, t) for k, t in d.items()} for d in out.loss_fn_outputs]
    names = set(arrays[0]) if arrays else set()
    for i, datum in enumerate(arrays):
        if set(datum) != names:
            raise ValueError(
                f"loss_fn_outputs[{i}] has fields {sorted(datum)}, datum 0 has {sorted(names)}"
            )
    start = 0
    for stop in range(1, len(arrays) + 1):
        if stop == len(arrays) or _layout(arrays[stop]) != _layout(arrays[start]):
            _fill_record(msg.loss_fn_outputs.add(), arrays[start:stop])
            start = stop
    return msg.SerializeToString()


def forward_backward_output_json(data: bytes) -> dict[str, object]:
    """The SDK's JSON shape of an encoded `ForwardBackwardOutput`, for a client that asks for JSON.

    Outputs are stored encoded only: building their JSON costs ~20x the protobuf (424 ms against
    12 ms for 128 datums x 2048 tokens), and the SDK always asks for protobuf.
    """
    msg = schema.new_message("ForwardBackwardOutput")
    msg.ParseFromString(data)
    outputs: list[dict[str, object]] = []
    for record in msg.loss_fn_outputs:
        datums: list[dict[str, object]] = [{} for _ in range(record.num_datums)]
        for name, batched in record.fields.items():
            dtype = _REQUEST_DTYPES[batched.dtype]
            offsets = np.frombuffer(batched.offsets, dtype="<i8")
            trailing = [int(n) for n in batched.trailing_shape]
            for i, datum in enumerate(datums):
                values = np.frombuffer(batched.data[offsets[i] : offsets[i + 1]], dtype=dtype)
                datum[name] = {
                    "data": values.tolist(),
                    "dtype": "float32" if dtype.kind == "f" else "int64",
                    "shape": [values.size // max(math.prod(trailing), 1), *trailing],
                }
        outputs.extend(datums)
    return {
        "loss_fn_output_type": msg.loss_fn_output_type,
        "loss_fn_outputs": outputs,
        "metrics": dict(msg.metrics),
    }


def _output_array(name: str, tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.is_complex():
        raise ValueError(f"loss_fn_outputs field {name!r} is complex; only real tensors encode")
    dtype = np.float32 if tensor.is_floating_point() else np.int64
    return tensor.to(torch.float32 if dtype is np.float32 else torch.int64).numpy().astype(dtype)


def _layout(datum: Mapping[str, np.ndarray]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {k: (a.dtype.str, a.shape[1:]) for k, a in datum.items()}


def _fill_record(record: Any, datums: list[dict[str, np.ndarray]]) -> None:
    record.num_datums = len(datums)
    for name in datums[0]:
        arrays = [
            np.ascontiguousarray(d[name]).astype(d[name].dtype.newbyteorder("<")) for d in datums
        ]
        batched = record.fields[name]
        batched.data = b"".join(a.tobytes() for a in arrays)
        offsets = np.cumsum([0, *(a.nbytes for a in arrays)], dtype=np.int64)
        batched.offsets = offsets.astype("<i8").tobytes()
        batched.dtype = schema.DTYPE_FLOAT32 if arrays[0].dtype.kind == "f" else schema.DTYPE_INT64
        batched.trailing_shape.extend(arrays[0].shape[1:])


def encode_sample_response(resp: SampleResponse) -> bytes:
    """A `SampleResponse` protobuf: int32 tokens, float32 logprobs, NaN for absent prompt logprobs."""
    msg = schema.new_message("SampleResponse")
    for i, seq in enumerate(resp.sequences):
        if seq.stop_reason not in _STOP_REASONS:
            raise ValueError(
                f"sequence {i}: stop_reason {seq.stop_reason!r} is not 'stop' or 'length'"
            )
        wire = msg.sequences.add()
        wire.stop_reason = _STOP_REASONS[seq.stop_reason]
        wire.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        if seq.logprobs is not None:
            if len(seq.logprobs) != len(seq.tokens):
                raise ValueError(
                    f"sequence {i}: {len(seq.logprobs)} logprobs for {len(seq.tokens)} tokens"
                )
            wire.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
    if resp.prompt_logprobs is not None:
        values = [math.nan if x is None else x for x in resp.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    return msg.SerializeToString()


def sample_response_to_json(resp: SampleResponse) -> dict[str, object]:
    """The SDK's JSON shape of a SampleResponse (`prompt_logprobs` holds None where undefined)."""
    return {
        "sequences": [
            {
                "stop_reason": seq.stop_reason,
                "tokens": [int(t) for t in seq.tokens],
                "logprobs": None if seq.logprobs is None else [float(x) for x in seq.logprobs],
            }
            for seq in resp.sequences
        ],
        "prompt_logprobs": None
        if resp.prompt_logprobs is None
        else [None if x is None else float(x) for x in resp.prompt_logprobs],
    }
