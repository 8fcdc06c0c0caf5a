"""The protobuf codec against the official tinker SDK 0.38: bytes the SDK writes decode to the
values put in, and bytes we write decode in the SDK to the values we encoded (float32-exact)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, cast

import numpy as np
import pytest
import torch

pytest.importorskip("tinker")
zstandard = pytest.importorskip("zstandard")

from google.protobuf import descriptor_pb2  # noqa: E402
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results  # noqa: E402
from tinker.proto import request_conv, response_conv  # noqa: E402
from tinker.proto import tinker_public_pb2 as sdk_pb  # noqa: E402
from tinker.types import (  # noqa: E402
    Datum,
    DmelChunk,
    EncodedTextChunk,
    ForwardBackwardInput,
    ImageChunk,
    LossFnType,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
    TensorData,
)
from tinker.types import ForwardBackwardRequest as SdkRequest  # noqa: E402

from posttrain.server import proto_schema  # noqa: E402
from posttrain.server.proto import (  # noqa: E402
    BodyTooLarge,
    ForwardBackwardRequest,
    ProtocolError,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
    forward_backward_output_json,
    sample_response_to_json,
)
from posttrain.types import ForwardBackwardOutput, SampledSequence, SampleResponse  # noqa: E402


def sdk_body(
    data: list[Datum],
    loss_fn: LossFnType = "cross_entropy",
    loss_fn_config: dict[str, float | str] | None = None,
    *,
    forward_only: bool = False,
    seq_id: int = 3,
) -> bytes:
    """The body the SDK posts to /forward_backward (resources/training.py does the same)."""
    request = SdkRequest(
        forward_backward_input=ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config
        ),
        model_id="model_abc",
        seq_id=seq_id,
    )
    msg = request_conv.forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def text_datum(tokens: list[int], **inputs: object) -> Datum:
    # The SDK's annotation says TensorData; at run time it coerces lists, numpy and torch.
    return Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=cast(Any, inputs))


def test_schema_is_the_sdk_schema() -> None:
    theirs = descriptor_pb2.FileDescriptorProto()
    sdk_pb.DESCRIPTOR.CopyToProto(theirs)
    mine = proto_schema.build_file_descriptor()
    assert mine.package == theirs.package == "tinker_public"
    assert mine.syntax == theirs.syntax == "proto3"
    sdk_messages = {m.name: m for m in theirs.message_type}
    # SamplingParams and its stop lists are the only messages left out (no 0.38 request uses them).
    assert set(sdk_messages) - {m.name for m in mine.message_type} == {
        "SamplingParams",
        "StopStrings",
        "StopTokens",
    }
    for message in mine.message_type:
        assert message == sdk_messages[message.name], message.name
    assert sorted(mine.enum_type, key=lambda e: e.name) == sorted(
        theirs.enum_type, key=lambda e: e.name
    )


def test_decodes_sdk_request_with_chunks_mixed_inputs_and_string_config() -> None:
    first = Datum(
        model_input=ModelInput(
            chunks=[
                EncodedTextChunk(tokens=[5, 6]),
                EncodedTextChunk(tokens=[70000, 0, 2**31 - 1]),
            ]
        ),
        loss_fn_inputs=cast(
            Any,
            {
                "target_tokens": [6, 70000, 0, 2**31 - 1, 9],
                "weights": [0.0, 0.5, -1.25, 1.0, 0.1],
                "advantages": np.array([1.5, -2.0, 0.0, 3.0, 1e-30], dtype=np.float32),
                "logprobs": torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5]),
            },
        ),
    )
    second = text_datum([1], target_tokens=[2], weights=[1.0])
    body = sdk_body(
        [first, second],
        "ppo",
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.25, "loss_id": "my-loss", "k": 3},
        forward_only=True,
        seq_id=41,
    )

    request = decode_forward_backward_request(body)

    assert isinstance(request, ForwardBackwardRequest)
    assert (request.model_id, request.seq_id, request.loss_fn) == ("model_abc", 41, "ppo")
    assert request.forward_only is True
    # 0.8 travels as a double (float(0.8)), so it comes back bit-identical.
    assert request.loss_fn_config == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.25,
        "loss_id": "my-loss",
        "k": 3.0,
    }
    d0, d1 = request.data
    assert [c.tokens for c in d0.model_input.chunks] == [(5, 6), (70000, 0, 2**31 - 1)]
    assert d0.model_input.to_ints() == [5, 6, 70000, 0, 2**31 - 1]
    assert d0.loss_fn_inputs["target_tokens"].dtype == torch.int64
    assert d0.loss_fn_inputs["target_tokens"].tolist() == [6, 70000, 0, 2**31 - 1, 9]
    expected_floats = {
        "weights": [0.0, 0.5, -1.25, 1.0, 0.1],
        "advantages": [1.5, -2.0, 0.0, 3.0, 1e-30],
        "logprobs": [-0.1, -0.2, -0.3, -0.4, -0.5],
    }
    for key, values in expected_floats.items():
        assert d0.loss_fn_inputs[key].dtype == torch.float32
        assert torch.equal(d0.loss_fn_inputs[key], torch.tensor(values, dtype=torch.float32)), key
    assert d1.model_input.to_ints() == [1]
    assert d1.loss_fn_inputs["target_tokens"].tolist() == [2]


def test_legacy_number_map_is_read_and_v2_wins() -> None:
    msg = sdk_pb.ForwardBackwardRequest(model_id="m", loss_fn="cispo")
    msg.loss_fn_config["clip_high_threshold"] = 4.0
    msg.loss_fn_config["beta"] = 0.5
    msg.loss_fn_config_v2["beta"].number = 0.25  # v2 wins where both carry a key
    request = decode_forward_backward_request(msg.SerializeToString())
    assert request.loss_fn_config == {"clip_high_threshold": 4.0, "beta": 0.25}
    assert request.data == [] and request.seq_id == 0 and request.forward_only is False


def test_two_dimensional_inputs_sent_sparse_decode_dense() -> None:
    target_NK = torch.zeros(6, 4, dtype=torch.int64)
    target_NK[1, 2] = 17
    target_NK[4, 0] = 3
    target_NK[4, 3] = 99
    weights_NK = torch.zeros(6, 4)
    weights_NK[1, 2] = 0.75
    weights_NK[4, 0] = -2.5
    weights_NK[4, 3] = 0.1
    datum = text_datum([1, 2, 3, 4, 5, 6], target_tokens=target_NK, weights=weights_NK)
    dense_NK = torch.arange(12, dtype=torch.float32).reshape(6, 2) / 7
    dense_datum = text_datum([7, 8, 9, 10, 11, 12], advantages=dense_NK)
    body = sdk_body([datum, dense_datum])
    sent = sdk_pb.ForwardBackwardRequest.FromString(body)
    # Make sure the test exercises both encodings.
    assert sent.data[0].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "sparse_csr"
    assert sent.data[0].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"
    assert sent.data[1].loss_fn_inputs["advantages"].WhichOneof("encoding") == "dense"

    first, second = decode_forward_backward_request(body).data

    assert torch.equal(first.loss_fn_inputs["target_tokens"], target_NK)
    assert torch.equal(first.loss_fn_inputs["weights"], weights_NK)
    assert first.loss_fn_inputs["weights"][4, 3].item() == np.float32(0.1)
    assert torch.equal(second.loss_fn_inputs["advantages"], dense_NK)


def test_zstd_body_and_provenance_spans() -> None:
    datum = text_datum([4, 5, 6], target_tokens=[5, 6, 7], weights=[1.0, 1.0, 0.5])
    datum = datum.with_provenance(
        model_input=[
            PromptProvenanceSpan(sequence_id="s1", offset=0, length=2),
            SampledProvenanceSpan(sequence_id="s1", offset=0, length=1),
        ],
        loss_fn_inputs=[SampledProvenanceSpan(sequence_id="s1", offset=0, length=3)],
    )
    body = sdk_body([datum], "cross_entropy")
    assert len(sdk_pb.ForwardBackwardRequest.FromString(body).data[0].model_input_spans) == 2
    compressed = zstandard.ZstdCompressor().compress(body)
    assert compressed != body

    plain = decode_forward_backward_request(body)
    unzipped = decode_forward_backward_request(compressed, "zstd")

    assert unzipped.data[0].model_input.to_ints() == [4, 5, 6]
    assert torch.equal(unzipped.data[0].loss_fn_inputs["weights"], torch.tensor([1.0, 1.0, 0.5]))
    assert unzipped.data[0].loss_fn_inputs["target_tokens"].tolist() == [5, 6, 7]
    assert plain.data[0].model_input.to_ints() == [4, 5, 6]
    assert decode_forward_backward_request(body, "identity").loss_fn == "cross_entropy"


def test_zstd_body_inflates_up_to_the_limit_only() -> None:
    body = _valid_body()
    compressed = zstandard.ZstdCompressor().compress(body)
    assert decode_forward_backward_request(compressed, "zstd", max_bytes=len(body)).loss_fn
    with pytest.raises(
        BodyTooLarge, match=f"inflates beyond the server's limit of {len(body) - 1}"
    ):
        decode_forward_backward_request(compressed, "zstd", max_bytes=len(body) - 1)
    # 1 GiB of zeros in ~32 KB: refused after inflating a little past 1 MiB, not 1 GiB.
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(1 << 30))
    with pytest.raises(BodyTooLarge):
        decode_forward_backward_request(bomb, "zstd", max_bytes=1 << 20)


def test_refusals_past_the_header_name_the_model_and_seq_id() -> None:
    # The server still gives the refused request's seq_id its turn in the model's order.
    mismatched = text_datum([1, 2, 3], target_tokens=[2, 3], weights=[1.0, 1.0, 1.0])
    with pytest.raises(
        ProtocolError, match=r"datum 0: Datum.loss_fn_inputs\['target_tokens'\]"
    ) as err:
        decode_forward_backward_request(sdk_body([mismatched], seq_id=7))
    assert (err.value.model_id, err.value.seq_id) == ("model_abc", 7)
    msg = sdk_pb.ForwardBackwardRequest(model_id="m", seq_id=4, loss_fn="cross_entropy")
    msg.data.add().model_input.add().encoded_text.tokens = np.asarray([1, -5], "<i4").tobytes()
    with pytest.raises(ProtocolError, match=r"datum 0: EncodedTextChunk.tokens\[1\] is -5") as err:
        decode_forward_backward_request(msg.SerializeToString())
    assert (err.value.model_id, err.value.seq_id) == ("m", 4)
    with pytest.raises(ProtocolError, match="not a valid") as err:
        decode_forward_backward_request(b"\xff\xff")
    assert (err.value.model_id, err.value.seq_id) == (None, None)


def _valid_body() -> bytes:
    return sdk_body([text_datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0, 1.0, 1.0])])


@pytest.mark.parametrize(
    ("body", "encoding", "message"),
    [
        (b"\xff\xff\xff\xff", None, "not a valid ForwardBackwardRequest protobuf"),
        (_valid_body()[:-7], None, "not a valid ForwardBackwardRequest protobuf"),
        (b"", None, "no model_id"),
        (b"this is not zstd", "zstd", "not valid zstd data"),
        (_valid_body(), "gzip", "unsupported Content-Encoding 'gzip'"),
    ],
    ids=["garbage", "truncated", "empty", "bad-zstd", "gzip"],
)
def test_malformed_bodies(body: bytes, encoding: str | None, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_forward_backward_request(body, encoding)


@pytest.mark.parametrize(
    ("chunk", "kind"),
    [(ImageChunk(data=b"\x89PNG....", format="png"), "image"), (DmelChunk(dmel=b"xx"), "dmel")],
)
def test_image_and_dmel_chunks_are_refused(chunk: object, kind: str) -> None:
    datum = Datum(
        model_input=ModelInput(chunks=[EncodedTextChunk(tokens=[1]), chunk]),  # pyright: ignore[reportArgumentType]
        loss_fn_inputs={},
    )
    with pytest.raises(
        ProtocolError, match=f"datum 0: model_input chunk 1: {kind} chunks are not supported"
    ):
        decode_forward_backward_request(sdk_body([datum]))


def _request_with_tensor(tensor: sdk_pb.Tensor, tokens: int = 2) -> bytes:
    msg = sdk_pb.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(tokens, dtype=np.int32).tobytes()
    datum.loss_fn_inputs["weights"].CopyFrom(tensor)
    return msg.SerializeToString()


def _csr(values: bytes, crow: list[int], col: list[int]) -> sdk_pb.SparseCsr:
    return sdk_pb.SparseCsr(
        values=values,
        crow_indices=np.array(crow, dtype=np.int64).tobytes(),
        col_indices=np.array(col, dtype=np.int64).tobytes(),
    )


F32 = sdk_pb.DTYPE_FLOAT32
ONE_F32 = np.array([1.0], dtype=np.float32).tobytes()


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (
            sdk_pb.Tensor(dense=b"\0\0", dtype=sdk_pb.DTYPE_BFLOAT16),
            r"dtype DTYPE_BFLOAT16 is not allowed in requests",
        ),
        (sdk_pb.Tensor(dense=b"\0" * 8, dtype=sdk_pb.DType.ValueType(9)), "dtype unknown DType 9"),
        (sdk_pb.Tensor(dense=b"\0" * 8), "dtype DTYPE_UNSPECIFIED"),
        (sdk_pb.Tensor(dense=b"\0" * 7, dtype=F32), "7 bytes is not a whole number of 4-byte"),
        (
            sdk_pb.Tensor(dense=b"\0" * 8, dtype=F32, shape=[3]),
            r"shape \[3\] needs 3 values, got 2",
        ),
        (sdk_pb.Tensor(dtype=F32), "neither dense nor sparse_csr"),
        (
            sdk_pb.Tensor(sparse_csr=_csr(ONE_F32, [0, 1, 1], [0]), dtype=F32),
            "sparse_csr tensor needs a 2-D shape, got \\[\\]",
        ),
        (
            sdk_pb.Tensor(sparse_csr=_csr(ONE_F32, [0, 1], [0]), dtype=F32, shape=[2, 2]),
            "crow_indices must rise",
        ),
        (
            sdk_pb.Tensor(sparse_csr=_csr(ONE_F32, [0, 1, 1], [5]), dtype=F32, shape=[2, 2]),
            r"one column in \[0, 2\)",
        ),
        (
            sdk_pb.Tensor(sparse_csr=_csr(ONE_F32 * 2, [0, 2, 2], [1, 1]), dtype=F32, shape=[2, 2]),
            "increasing within each row",
        ),
        (
            sdk_pb.Tensor(sparse_csr=_csr(b"", [0], []), dtype=F32, shape=[2, 1 << 40]),
            "over the limit",
        ),
    ],
    ids=[
        "bf16",
        "unknown-dtype",
        "unspecified-dtype",
        "ragged-bytes",
        "shape-mismatch",
        "no-data",
        "sparse-no-shape",
        "bad-crow",
        "col-out-of-range",
        "duplicate-col",
        "huge-sparse",
    ],
)
def test_bad_tensors(tensor: sdk_pb.Tensor, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        decode_forward_backward_request(_request_with_tensor(tensor))
    assert "datum 0: loss_fn_inputs['weights']" in str(info.value)


def test_datum_errors_name_the_datum() -> None:
    good = text_datum([1, 2], weights=[1.0, 1.0])
    bad = text_datum([1, 2, 3], weights=[1.0, 1.0])
    with pytest.raises(ProtocolError, match=r"datum 1: Datum.loss_fn_inputs\['weights'\]"):
        decode_forward_backward_request(sdk_body([good, bad]))
    msg = sdk_pb.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy")
    msg.data.add().model_input.add().encoded_text.tokens = b"\0\0\0"
    with pytest.raises(ProtocolError, match="datum 0: model_input chunk 0 tokens: 3 bytes"):
        decode_forward_backward_request(msg.SerializeToString())
    msg = sdk_pb.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy")
    msg.data.add().model_input.add()
    with pytest.raises(ProtocolError, match="datum 0: model_input chunk 0 is empty"):
        decode_forward_backward_request(msg.SerializeToString())
    msg = sdk_pb.ForwardBackwardRequest(model_id="m", loss_fn="ppo")
    msg.loss_fn_config_v2["beta"].SetInParent()
    with pytest.raises(ProtocolError, match=r"loss_fn_config_v2\['beta'\] has neither"):
        decode_forward_backward_request(msg.SerializeToString())


def test_forward_backward_output_decodes_in_sdk() -> None:
    logprobs = [torch.tensor([-0.1, -2.5, -1e-8]), torch.tensor([-3.0]), torch.tensor([-0.7, 0.0])]
    outputs = [
        {
            "logprobs": lp,
            "elementwise_loss": (lp * 3).to(torch.float64),  # float64 goes out as float32
            "argmax": torch.arange(lp.numel()) * 1000,
        }
        for lp in logprobs
    ]
    metrics = {"loss:sum": 12.345678901234, "tokens:sum": 6.0, "ratio_p95:max": 1.5}
    out = ForwardBackwardOutput("ArrayRecord", outputs, metrics)

    decoded = response_conv.deserialize_forward_backward_output(encode_forward_backward_output(out))

    assert decoded.loss_fn_output_type == "ArrayRecord"
    assert decoded.metrics == metrics  # doubles on the wire: exact
    assert len(decoded.loss_fn_outputs) == 3
    for lp, got in zip(logprobs, decoded.loss_fn_outputs, strict=True):
        assert set(got) == {"logprobs", "elementwise_loss", "argmax"}
        assert got["logprobs"].dtype == "float32"
        assert got["logprobs"].shape == [lp.numel()]
        assert torch.equal(got["logprobs"].to_torch(), lp)
        assert torch.equal(got["elementwise_loss"].to_torch(), (lp * 3).to(torch.float64).float())
        assert got["argmax"].dtype == "int64"
        assert got["argmax"].to_torch().tolist() == [1000 * i for i in range(lp.numel())]
    sent = sdk_pb.ForwardBackwardOutput.FromString(encode_forward_backward_output(out))
    assert len(sent.loss_fn_outputs) == 1
    record = sent.loss_fn_outputs[0]
    assert record.num_datums == 3
    assert np.frombuffer(record.fields["logprobs"].offsets, np.int64).tolist() == [0, 12, 16, 24]
    assert record.fields["argmax"].dtype == sdk_pb.DTYPE_INT64
    # The SDK merges chunked results by metric reduction; our keys must survive that.
    combined = combine_fwd_bwd_output_results([decoded, decoded])
    assert combined.metrics["loss:sum"] == 2 * metrics["loss:sum"]


def test_two_dimensional_and_ragged_outputs() -> None:
    a_NK = torch.tensor([[-0.5, -1.5], [-0.25, -4.0], [-8.0, 0.125]])
    b_NK = torch.tensor([[-1.0, -2.0]])
    c_NK = torch.tensor([[-1.0, -2.0, -3.0]])  # a different K starts a second ArrayRecord
    out = ForwardBackwardOutput("ArrayRecord", [{"logprobs": t} for t in (a_NK, b_NK, c_NK)], {})
    body = encode_forward_backward_output(out)
    sent = sdk_pb.ForwardBackwardOutput.FromString(body)
    assert [r.num_datums for r in sent.loss_fn_outputs] == [2, 1]
    assert list(sent.loss_fn_outputs[0].fields["logprobs"].trailing_shape) == [2]

    decoded = response_conv.deserialize_forward_backward_output(body)

    for original, got in zip((a_NK, b_NK, c_NK), decoded.loss_fn_outputs, strict=True):
        assert got["logprobs"].shape == list(original.shape)
        assert torch.equal(got["logprobs"].to_torch(), original)


def test_output_json_is_the_sdks_json_of_the_same_values() -> None:
    """Outputs are stored encoded; a client asking for JSON gets it decoded from the protobuf."""
    ragged = [torch.tensor([-0.5, -1.5, 1e-9]), torch.tensor([-2.0]), torch.tensor([[-1.0, 0.25]])]
    outputs = [{"logprobs": t, "index": torch.arange(t.numel())} for t in ragged]
    metrics = {"loss:sum": 1.2345678901234, "tokens:sum": 6.0}
    body = encode_forward_backward_output(ForwardBackwardOutput("ArrayRecord", outputs, metrics))

    as_json = json.loads(json.dumps(forward_backward_output_json(body)))

    assert as_json["loss_fn_output_type"] == "ArrayRecord" and as_json["metrics"] == metrics
    assert len(as_json["loss_fn_outputs"]) == len(outputs)
    for original, got in zip(outputs, as_json["loss_fn_outputs"], strict=True):
        assert set(got) == set(original)
        for name, tensor in original.items():
            data = TensorData(**got[name])  # the JSON fields of the SDK's tensor
            assert data.shape == list(tensor.shape)
            assert torch.equal(data.to_torch(), tensor)  # float32 values survive exactly


def test_empty_output_and_bad_outputs() -> None:
    empty = response_conv.deserialize_forward_backward_output(
        encode_forward_backward_output(ForwardBackwardOutput("ArrayRecord", [], {"loss:sum": 0.0}))
    )
    assert empty.loss_fn_outputs == [] and empty.metrics == {"loss:sum": 0.0}
    with pytest.raises(ValueError, match="metric key 'loss'"):
        encode_forward_backward_output(ForwardBackwardOutput("ArrayRecord", [], {"loss": 1.0}))
    with pytest.raises(ValueError, match=r"loss_fn_outputs\[1\] has fields"):
        encode_forward_backward_output(
            ForwardBackwardOutput(
                "ArrayRecord", [{"logprobs": torch.zeros(1)}, {"x": torch.zeros(1)}], {}
            )
        )


def _sample_response() -> SampleResponse:
    return SampleResponse(
        sequences=[
            SampledSequence("stop", [11, 12, 151643], [-0.1, -0.2, -1e-7]),
            SampledSequence("length", [2**31 - 1, 0], [-30.5, 0.0]),
        ],
        prompt_logprobs=[None, -1.5, -0.1],
    )


def test_sample_response_decodes_in_sdk() -> None:
    decoded = response_conv.deserialize_sample_response(encode_sample_response(_sample_response()))

    first, second = decoded.sequences
    assert (first.stop_reason, second.stop_reason) == ("stop", "length")
    assert first.tokens == [11, 12, 151643]
    assert second.tokens == [2**31 - 1, 0]
    # float32 on the wire: exactly the float32 rounding of what was encoded.
    assert first.logprobs == np.array([-0.1, -0.2, -1e-7], dtype=np.float32).tolist()
    assert second.logprobs == [-30.5, 0.0]
    assert decoded.prompt_logprobs == [None, -1.5, float(np.float32(-0.1))]


def test_sample_response_without_logprobs() -> None:
    resp = SampleResponse(sequences=[SampledSequence("length", [3, 4])])
    decoded = response_conv.deserialize_sample_response(encode_sample_response(resp))
    assert decoded.sequences[0].tokens == [3, 4]
    assert decoded.sequences[0].logprobs is None
    assert decoded.prompt_logprobs is None
    with pytest.raises(ValueError, match="sequence 0: 1 logprobs for 2 tokens"):
        encode_sample_response(SampleResponse([SampledSequence("stop", [1, 2], [-1.0])]))


def test_sample_response_json() -> None:
    as_json = sample_response_to_json(_sample_response())
    assert as_json == {
        "sequences": [
            {"stop_reason": "stop", "tokens": [11, 12, 151643], "logprobs": [-0.1, -0.2, -1e-7]},
            {"stop_reason": "length", "tokens": [2**31 - 1, 0], "logprobs": [-30.5, 0.0]},
        ],
        "prompt_logprobs": [None, -1.5, -0.1],
    }
    assert json.loads(json.dumps(as_json)) == as_json
    assert sample_response_to_json(SampleResponse([SampledSequence("stop", [1])])) == {
        "sequences": [{"stop_reason": "stop", "tokens": [1], "logprobs": None}],
        "prompt_logprobs": None,
    }


def test_codec_works_without_the_sdk() -> None:
    body = _valid_body()
    script = (
        "import sys; sys.modules['tinker'] = None\n"
        "from posttrain.server.proto import decode_forward_backward_request as d\n"
        f"r = d({body!r})\n"
        "assert r.data[0].model_input.to_ints() == [1, 2, 3], r\n"
        "assert 'tinker' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
