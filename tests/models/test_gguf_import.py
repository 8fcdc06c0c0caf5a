"""A .gguf file as a base model: converted once (transformers' reader, the gguf package) into a
safetensors directory that computes what the original model does, cached by the file's sha256,
never half-written, with clear errors. The GGUF files are written here (tests/gguf_files.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_files import logits, write_gguf_of_architecture, write_tiny_gguf
from posttrain.models import gguf as gguf_import
from posttrain.models.cache import ModelSourceError, sha256_file
from posttrain.models.gguf import (
    RECORD,
    cache_entry,
    cached_gguf,
    check_gguf_file,
    file_sha256,
    import_gguf,
    lossless_dtype,
)
from posttrain.models.gguf_header import read_layout
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.models.source import cache_note, check_base_model, resolve_model_source

# <|bos|> <|im_start|> "Hi\n" <|eos|> <|pad|> and bytes from both ends of the byte range.
IDS = [256, 259, 72, 105, 10, 257, 258, 0, 1, 200, 255]


pytestmark = pytest.mark.usefixtures("posttrain_cache")


def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files `convert_gguf` is called on from now on (it still converts)."""
    calls: list[Path] = []
    convert = gguf_import.convert_gguf

    def counted(path: Path, out: Path, **kwargs: object) -> None:
        calls.append(path)
        convert(path, out, **kwargs)  # pyright: ignore[reportArgumentType]

    monkeypatch.setattr(gguf_import, "convert_gguf", counted)
    return calls


def test_the_converted_model_computes_exactly_what_the_original_does(tiny_gguf):
    gguf_path, original = tiny_gguf
    # Dequantizing an F32 tensor copies it, and undoing llama.cpp's Q/K row permutation only
    # reorders rows back: the same float32 weights, hence bit-equal logits.
    assert torch.equal(logits(gguf_path, IDS), logits(original, IDS))
    converted = Path(resolve_model_source(gguf_path))
    assert converted == cache_entry(sha256_file(gguf_path))
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config  # a plain model directory, not read as GGUF
    assert config["dtype"] == "float32"
    record = json.loads((converted / RECORD).read_text())
    assert (record["source"], record["dtype"]) == ("tiny.gguf", "float32")
    assert record["sha256"] == sha256_file(gguf_path)


def test_a_tied_unembedding_stays_tied(tmp_path):
    gguf_path = tmp_path / "tied.gguf"
    original = write_tiny_gguf(gguf_path, seed=4, tied=True)  # no output.weight in the file
    converted = import_gguf(gguf_path)
    assert json.loads((converted / "config.json").read_text())["tie_word_embeddings"] is True
    model = load_hf_model(converted)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert torch.equal(logits(gguf_path, IDS), logits(original, IDS, tied=True))


def test_the_tokenizer_and_chat_template_round_trip(tiny_gguf):
    gguf_path, original = tiny_gguf
    ours, theirs = load_tokenizer(gguf_path), load_tokenizer(original)
    for text in ["Hello, wörld!\n", " 7 + 5 = 12", "<|im_start|>user\nhi<|eos|>", "ß→✓"]:
        assert ours(text).input_ids == theirs(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == text
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    rendered = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert rendered == theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    specials = ("bos_token", "eos_token", "pad_token")
    assert [getattr(ours, s) for s in specials] == [getattr(theirs, s) for s in specials]
    assert ours.model_max_length == 512  # the model's context, not transformers' 1e30 default


def test_an_f16_file_is_saved_in_float16_and_loads_back_exactly(tmp_path):
    gguf_path = tmp_path / "half.gguf"
    original = write_tiny_gguf(gguf_path, seed=5, half=True)
    converted = import_gguf(gguf_path)
    # float16 holds every weight (the matrices were stored as F16; the norms are ones), and
    # bfloat16 does not (float16 keeps 10 fraction bits, bfloat16 7).
    assert json.loads((converted / "config.json").read_text())["dtype"] == "float16"
    assert torch.equal(logits(gguf_path, IDS), logits(original, IDS, half=True))


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([1.0, 0.5, -3.0], torch.bfloat16),  # exact in all three
        ([1.0 + 2**-7], torch.bfloat16),  # bfloat16 keeps 7 fraction bits
        ([1.0 + 2**-10], torch.float16),  # float16 keeps 10, bfloat16 rounds this to 1
        ([1.0 + 2**-12], torch.float32),  # more than float16's 10
        ([98304.0], torch.bfloat16),  # 1.5 * 2**16: past float16's largest (65504)
        ([98304.0, 1.0 + 2**-10], torch.float32),  # each half type loses one of them
    ],
)
def test_lossless_dtype(values, dtype):
    tensors = [torch.tensor([v], dtype=torch.float32) for v in values]
    assert lossless_dtype([torch.tensor([1, 2]), *tensors]) == dtype  # integers don't count


def test_a_second_use_reads_the_cache_without_converting_or_hashing(tiny_gguf, monkeypatch):
    gguf_path, _ = tiny_gguf
    calls = conversions(monkeypatch)
    first = import_gguf(gguf_path)
    assert calls == [gguf_path]

    def no_hashing(path: Path) -> str:
        raise AssertionError("the file was hashed again")

    monkeypatch.setattr(gguf_import, "sha256_file", no_hashing)
    assert import_gguf(gguf_path) == first
    assert resolve_model_source(str(gguf_path)) == str(first)
    assert cached_gguf(gguf_path) == first
    assert calls == [gguf_path]


def test_the_converted_model_has_the_umasks_modes(tmp_path, wrong_modes):
    # A packaged model is a GGUF file converted the same way into the same cache.
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, seed=6)
    assert wrong_modes(import_gguf(gguf_path)) == {}


def test_a_changed_file_is_hashed_and_converted_again(tmp_path):
    gguf_path = tmp_path / "model.gguf"
    write_tiny_gguf(gguf_path, seed=1)
    first = import_gguf(gguf_path)
    os.utime(gguf_path, ns=(1, 1))  # another mtime: the remembered hash no longer applies
    write_tiny_gguf(gguf_path, seed=2)
    second = import_gguf(gguf_path)
    assert second != first and second.name.startswith(sha256_file(gguf_path))


def test_import_model_writes_a_directory_of_its_own(tiny_gguf, tmp_path, monkeypatch):
    gguf_path, original = tiny_gguf
    calls = conversions(monkeypatch)
    out = import_gguf(gguf_path, tmp_path / "out")
    assert out == tmp_path / "out" and calls == [gguf_path]  # converted straight there
    assert not cached_gguf(gguf_path)
    assert torch.equal(logits(out, IDS), logits(original, IDS))
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        import_gguf(gguf_path, out)
    cached = import_gguf(gguf_path)
    copied = import_gguf(gguf_path, tmp_path / "copy")  # copied from the cache now
    assert calls == [gguf_path, gguf_path]
    assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in cached.iterdir())


def test_a_failed_conversion_leaves_no_cache_entry(tiny_gguf, monkeypatch, posttrain_cache):
    gguf_path, _ = tiny_gguf

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    # Fails after the weights are written, while the tokenizer is saved.
    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", full_disk)
    with pytest.raises(OSError, match="No space left"):
        import_gguf(gguf_path)
    monkeypatch.undo()
    monkeypatch.setenv("POSTTRAIN_CACHE", str(posttrain_cache))
    entries = [
        p.name for p in (posttrain_cache / "gguf").iterdir() if p.name not in ("hashes", "locks")
    ]
    assert entries == []  # neither an entry nor its temporary directory
    assert (import_gguf(gguf_path) / "tokenizer.json").is_file()


KILLED = """
import os, signal, sys
import transformers
from posttrain.models.gguf import import_gguf
def killed(*args, **kwargs):  # saving the tokenizer: the weights are written by now
    os.kill(os.getpid(), signal.SIGKILL)
transformers.PreTrainedTokenizerBase.save_pretrained = killed
import_gguf(sys.argv[1])
"""


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: seconds to a minute
def test_a_killed_conversion_leaves_no_cache_entry(tiny_gguf, posttrain_cache):
    gguf_path, _ = tiny_gguf
    proc = subprocess.run(
        [sys.executable, "-c", KILLED, str(gguf_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    entry = cache_entry(sha256_file(gguf_path))
    assert not entry.exists()
    (partial,) = entry.parent.glob(f".{entry.name}.partial-*")  # what the kill left behind
    assert (partial / "model.safetensors").is_file()
    assert cached_gguf(gguf_path) is None
    assert import_gguf(gguf_path) == entry
    assert not partial.exists()  # swept by the next conversion


def test_concurrent_imports_convert_once(tiny_gguf, monkeypatch):
    gguf_path, _ = tiny_gguf
    calls = conversions(monkeypatch)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(import_gguf(gguf_path))) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # The second waited on the lock, then found the first's entry.
    assert calls == [gguf_path]
    assert len(results) == 2 and results[0] == results[1]


def test_the_file_hash_is_remembered(tiny_gguf, posttrain_cache):
    gguf_path, _ = tiny_gguf
    digest = file_sha256(gguf_path)
    assert digest == sha256_file(gguf_path)
    (record,) = (posttrain_cache / "gguf" / "hashes").iterdir()
    saved = json.loads(record.read_text())
    assert (saved["sha256"], saved["size"]) == (digest, gguf_path.stat().st_size)


def test_check_and_cache_note_before_and_after_conversion(tiny_gguf):
    gguf_path, _ = tiny_gguf
    check_base_model(str(gguf_path))
    assert "not converted yet" in (cache_note(str(gguf_path)) or "")
    entry = import_gguf(gguf_path)
    assert cache_note(str(gguf_path)) == f"cached at {entry}"
    assert cache_note("Qwen/Qwen3-0.6B") is None


def test_a_missing_file_names_it(tmp_path):
    missing = tmp_path / "nope.gguf"
    for call in (check_base_model, resolve_model_source):
        with pytest.raises(FileNotFoundError, match=r"GGUF file '.*nope\.gguf' does not exist"):
            call(str(missing))


def test_a_file_that_is_not_gguf_says_so(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip file")
    for call in (check_base_model, import_gguf):
        with pytest.raises(ModelSourceError, match=r"model\.gguf does not start with the GGUF"):
            call(fake)


# Where a download may stop in the tiny file (436,384 bytes: metadata from byte 24, the tensor
# table from 5,829, data from 7,072 to the end): in the counts, the metadata (the tokenizer's),
# the tensor table, the data, and one byte short of the end.
CUTS = {"counts": 12, "metadata": 600, "tensor table": 6400, "data": 0.5, "last byte": -1}


@pytest.mark.parametrize("keep", CUTS.values(), ids=CUTS.keys())
def test_a_truncated_file_is_named_with_the_fix(tiny_gguf, tmp_path, keep):
    gguf_path, _ = tiny_gguf
    data = gguf_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)] if isinstance(keep, float) else data[:keep])
    # Preflight reads the header and the tensor table (not the data) and finds the damage, so
    # neither explain nor doctor passes a file that train would then refuse at conversion.
    for call in (check_base_model, import_gguf):
        with pytest.raises(ModelSourceError, match=r"cut\.gguf is truncated or damaged") as info:
            call(cut)
        assert "download it again and compare its sha256" in str(info.value)
    assert cached_gguf(cut) is None


@pytest.mark.parametrize("order", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_the_layout_is_read_from_the_header_alone(tmp_path, order):
    """Offsets from the tensor table, sizes from the ggml types, the data section aligned by
    general.alignment, in either byte order."""
    path = tmp_path / "two.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=order)
    writer.add_custom_alignment(64)
    writer.add_tensor("a", np.zeros((3, 5), np.float32))  # 60 bytes, padded to 64
    writer.add_tensor("b", np.zeros(7, np.float16))  # 14 bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    layout = read_layout(path)
    assert (layout.version, layout.tensors, layout.data_offset % 64) == (3, 2, 0)
    assert layout.data_end == layout.data_offset + 64 + 14 <= path.stat().st_size
    check_gguf_file(path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: layout.data_end - 1])
    with pytest.raises(ModelSourceError, match=f"its tensor table needs {layout.data_end} bytes"):
        check_gguf_file(cut)


def test_an_architecture_transformers_cannot_read_is_named(tmp_path):
    path = tmp_path / "rwkv.gguf"
    write_gguf_of_architecture(path, "rwkv6")
    with pytest.raises(ModelSourceError) as info:
        import_gguf(path)
    message = str(info.value)
    assert "cannot read GGUF file" in message and "rwkv.gguf" in message
    assert "architecture 'rwkv6'" in message and "original model's directory" in message


def test_a_missing_gguf_package_names_the_extra(tiny_gguf, monkeypatch):
    gguf_path, _ = tiny_gguf
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name)
    )
    for call in (check_base_model, resolve_model_source):
        with pytest.raises(ModelSourceError, match=r"needs the gguf package.*posttrain\[gguf\]"):
            call(str(gguf_path))
