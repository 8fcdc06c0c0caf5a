"""The `tinker_public` protobuf schema (proto3) as message classes built at import time.

The schema is written here as data, assembled into a `FileDescriptorProto` and loaded into a
private descriptor pool, so neither protoc nor the `tinker` SDK is needed at run time, and the
SDK's own generated module (which registers the same names in the default pool) can be imported
in the same process without a clash. Field names and numbers follow the wire-protocol spec
(section 7); `SamplingParams` is left out because no 0.38 request carries it.

The generated classes have no static types, so `new_message` returns them as `Any`.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "tinker_public"

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "bool": _F.TYPE_BOOL,
    "double": _F.TYPE_DOUBLE,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
}

ENUMS: dict[str, list[tuple[str, int]]] = {
    "DType": [
        ("DTYPE_UNSPECIFIED", 0),
        ("DTYPE_FLOAT32", 1),
        ("DTYPE_INT64", 2),
        ("DTYPE_INT32", 3),
        ("DTYPE_BFLOAT16", 4),
    ],
    "StopReason": [("STOP_REASON_STOP", 0), ("STOP_REASON_LENGTH", 1)],
}

# message -> fields as (name, number, type). A type is a scalar, an enum or a message name,
# optionally prefixed "repeated " or "optional " (proto3 explicit presence), or "map<K,V>".
# A fourth element names the oneof the field belongs to.
MESSAGES: dict[str, list[tuple[str, int, str] | tuple[str, int, str, str]]] = {
    "ForwardBackwardRequest": [
        ("model_id", 1, "string"),
        ("seq_id", 2, "int32"),
        ("data", 3, "repeated Datum"),
        ("loss_fn", 4, "string"),
        ("loss_fn_config", 5, "map<string,double>"),
        ("forward_only", 6, "bool"),
        ("loss_fn_config_v2", 7, "map<string,LossConfigValue>"),
    ],
    "LossConfigValue": [("number", 1, "double", "value"), ("text", 2, "string", "value")],
    "Datum": [
        ("model_input", 1, "repeated Chunk"),
        ("loss_fn_inputs", 2, "map<string,Tensor>"),
        ("model_input_spans", 3, "repeated ProvenanceSpan"),
        ("loss_fn_input_spans", 4, "repeated ProvenanceSpan"),
    ],
    "Chunk": [
        ("encoded_text", 1, "EncodedTextChunk", "chunk"),
        ("image", 2, "ImageChunk", "chunk"),
        ("dmel", 3, "DmelChunk", "chunk"),
    ],
    "EncodedTextChunk": [("tokens", 1, "bytes")],
    "ImageChunk": [
        ("data", 1, "bytes"),
        ("format", 2, "string"),
        ("expected_tokens", 3, "optional int32"),
        ("override_dimensions", 4, "optional ImageDimensions"),
    ],
    "ImageDimensions": [("width", 1, "uint32"), ("height", 2, "uint32")],
    "DmelChunk": [("dmel", 1, "bytes")],
    "Tensor": [
        ("dense", 1, "bytes", "encoding"),
        ("sparse_csr", 2, "SparseCsr", "encoding"),
        ("dtype", 3, "DType"),
        ("shape", 4, "repeated int64"),
    ],
    "SparseCsr": [
        ("values", 1, "bytes"),
        ("crow_indices", 2, "bytes"),
        ("col_indices", 3, "bytes"),
    ],
    "ProvenanceSpan": [
        ("prompt_tokens", 1, "PromptProvenanceSpan", "span"),
        ("sampled_tokens", 2, "SampledProvenanceSpan", "span"),
    ],
    "PromptProvenanceSpan": [
        ("sequence_id", 1, "string"),
        ("offset", 2, "int64"),
        ("length", 3, "int64"),
    ],
    "SampledProvenanceSpan": [
        ("sequence_id", 1, "string"),
        ("offset", 2, "int64"),
        ("length", 3, "int64"),
    ],
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, "string"),
        ("loss_fn_outputs", 2, "repeated ArrayRecord"),
        ("metrics", 3, "map<string,double>"),
    ],
    "ArrayRecord": [
        ("type_tag", 1, "string"),
        ("fields", 2, "map<string,BatchedTensor>"),
        ("num_datums", 3, "int64"),
    ],
    "BatchedTensor": [
        ("data", 1, "bytes"),
        ("offsets", 2, "bytes"),
        ("dtype", 3, "DType"),
        ("trailing_shape", 4, "repeated int64"),
    ],
    "SampleResponse": [
        ("sequences", 1, "repeated SampledSequence"),
        ("prompt_logprobs", 2, "optional bytes"),
        ("topk_prompt_logprobs", 3, "optional TopkLogprobs"),
        ("prompt_cache_hit_tokens", 4, "int32"),
        ("target_prompt_logprobs", 5, "optional Tensor"),
        ("prompt_alt_tokens", 6, "optional PromptAltTokens"),
    ],
    "SampledSequence": [
        ("stop_reason", 1, "StopReason"),
        ("tokens", 2, "bytes"),
        ("logprobs", 3, "optional bytes"),
        ("topk_sampled_logprobs", 4, "optional TopkLogprobs"),
    ],
    "TopkLogprobs": [
        ("token_ids", 1, "bytes"),
        ("logprobs", 2, "bytes"),
        ("k", 3, "uint32"),
        ("length", 4, "uint32"),
    ],
    "PromptAltTokens": [("tokens", 1, "Tensor"), ("logprobs", 2, "Tensor")],
}


def _set_type(field: _F, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    else:
        field.type = _F.TYPE_ENUM if type_name in ENUMS else _F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{type_name}"


def _map_entry(
    parent: descriptor_pb2.DescriptorProto, parent_path: str, name: str, spec: str
) -> str:
    """Add the nested `<Name>Entry` message protoc generates for a map field; return its path."""
    key_type, value_type = spec.removeprefix("map<").removesuffix(">").split(",")
    entry = parent.nested_type.add(name="".join(p.title() for p in name.split("_")) + "Entry")
    entry.options.map_entry = True
    for number, (field_name, type_name) in enumerate(
        [("key", key_type), ("value", value_type)], start=1
    ):
        field = entry.field.add(name=field_name, number=number, label=_F.LABEL_OPTIONAL)
        _set_type(field, type_name)
    return f"{parent_path}.{entry.name}"


def _message(
    name: str, fields: list[tuple[str, int, str] | tuple[str, int, str, str]]
) -> descriptor_pb2.DescriptorProto:
    msg = descriptor_pb2.DescriptorProto(name=name)
    real_oneofs = list(dict.fromkeys(f[3] for f in fields if len(f) == 4))
    for oneof in real_oneofs:
        msg.oneof_decl.add(name=oneof)
    synthetic: list[tuple[_F, str]] = []
    for spec in fields:
        field_name, number, type_spec = spec[0], spec[1], spec[2]
        field = msg.field.add(name=field_name, number=number, label=_F.LABEL_OPTIONAL)
        if type_spec.startswith("map<"):
            field.label = _F.LABEL_REPEATED
            field.type = _F.TYPE_MESSAGE
            field.type_name = _map_entry(msg, f".{PACKAGE}.{name}", field_name, type_spec)
            continue
        label, _, type_name = type_spec.rpartition(" ")
        _set_type(field, type_name)
        if label == "repeated":
            field.label = _F.LABEL_REPEATED
        elif label == "optional":
            field.proto3_optional = True
            synthetic.append((field, f"_{field_name}"))
        if len(spec) == 4:
            field.oneof_index = real_oneofs.index(spec[3])
    # protoc puts the synthetic oneofs of proto3 `optional` fields after the real ones.
    for field, oneof in synthetic:
        field.oneof_index = len(msg.oneof_decl)
        msg.oneof_decl.add(name=oneof)
    return msg


def build_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The schema as a `FileDescriptorProto` (what protoc would produce from the .proto)."""
    file = descriptor_pb2.FileDescriptorProto(
        name="tinker_public.proto", package=PACKAGE, syntax="proto3"
    )
    for enum_name, values in ENUMS.items():
        enum = file.enum_type.add(name=enum_name)
        for value_name, number in values:
            enum.value.add(name=value_name, number=number)
    for name, fields in MESSAGES.items():
        file.message_type.append(_message(name, fields))
    return file


_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(build_file_descriptor().SerializeToString())
_CLASSES = {
    name: message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))
    for name in MESSAGES
}

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
STOP_REASON_STOP, STOP_REASON_LENGTH = 0, 1


def new_message(name: str) -> Any:
    """A fresh, empty message of the schema's type `name` (e.g. "ForwardBackwardRequest")."""
    return _CLASSES[name]()


def dtype_name(value: int) -> str:
    """The DType enum name of `value`, or "unknown DType <n>"."""
    names = {number: name for name, number in ENUMS["DType"]}
    return names.get(value, f"unknown DType {value}")
