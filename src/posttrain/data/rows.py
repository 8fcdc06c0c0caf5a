"""Rows of a dataset in any common format, one reader for the dataset task, SFT and DPO data.

`open_rows(spec)` opens:
- a `.jsonl` file (one JSON object per non-blank line; any other unknown suffix too, as before),
- a `.json` file (a list of objects, or one object per line),
- a `.csv` file (a header line; every cell is text, so "007" stays "007"; an empty cell is a
  missing field),
- a `.parquet` or `.arrow` file,
- a directory written by `datasets.save_to_disk`: a Dataset, or a DatasetDict whose split is
  `DIR@SPLIT` or the `split` argument (not needed when it has one split),
- `hf:NAME[:CONFIG][@SPLIT]`, a dataset on the Hugging Face hub.

JSONL and JSON are read with the standard library. The others need the `datasets` library
(`pip install 'posttrain[data]'`) and stay in its memory-mapped Arrow files: a row becomes a
Python dict only when it is asked for (`rows[i]`, or `records()` streaming through them all in
batches), so a large file is never held as Python objects. In Arrow a missing value is null,
so a null field of a row counts as missing there.

Errors name the source and the row: `file.jsonl:12` (the line) for JSONL and JSON lines,
`file.parquet, row 12` (1-based) for the rest. `digest()` says what a resumed run compares: the
sha256 of a file, a sha256 over a directory's files, or a hub dataset's fingerprint.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

if TYPE_CHECKING:
    from datasets import Dataset

HUB_PREFIX = "hf:"
EXTRA = "pip install 'posttrain[data]'"
# Suffixes read through the `datasets` library; any other file is JSONL.
ARROW_FORMATS = {".csv": "CSV", ".parquet": "Parquet", ".pq": "Parquet", ".arrow": "Arrow"}
FORMATS = "JSONL, JSON, CSV, Parquet, Arrow, a datasets.save_to_disk directory, hf:NAME"
# What turns datasets' hub access off (datasets reads them when it is imported).
OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
BATCH_ROWS = 1024  # rows per batch when streaming through an Arrow table
DigestKind = Literal["sha256", "fingerprint"]


def resolve_spec(spec: str, base: Path) -> str | Path:
    """A config's data option as the reader takes it: a hub id as it is, a path from `base`."""
    return spec if spec.startswith(HUB_PREFIX) else base / spec


def parse_hub_id(spec: str) -> tuple[str, str | None, str | None]:
    """`hf:NAME[:CONFIG][@SPLIT]` -> (name, config, split); NAME may be `owner/name`."""
    body = spec.removeprefix(HUB_PREFIX)
    body, at, split = body.partition("@")
    name, colon, config = body.partition(":")
    if not name or (colon and not config) or (at and not split) or ":" in config:
        raise ValueError(
            f"{spec!r} is not a hub dataset id: write hf:NAME, hf:NAME:CONFIG, or either with "
            "@SPLIT (hf:openai/gsm8k:main@train)"
        )
    return name, config or None, split or None


class Rows(Sequence[dict[str, Any]]):
    """The rows of one source: `rows[i]` is row i's dict, `where(i)` how errors name it."""

    source: str  # how errors name the source: the path or hub id, with its split
    unit = "row"  # what errors call a row: "line" where `where` gives line numbers

    def where(self, index: int) -> str:
        return f"{self.source}, row {index + 1}"

    def records(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(index, row) of every row, in order, without keeping them."""
        for index in range(len(self)):
            yield index, self[index]

    @abstractmethod
    def digest(self) -> tuple[DigestKind, str]:
        """What job.json records to tell a resumed run's data from the original's."""


class JsonRows(Rows):
    """Rows parsed with the standard library, kept as dicts (a JSONL or JSON file)."""

    def __init__(self, path: Path, rows: list[dict[str, Any]], lines: list[int] | None) -> None:
        self.path, self.source = path, str(path)
        self._rows, self._lines = rows, lines  # lines: each row's line number, if by line
        self.unit = "row" if lines is None else "line"

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | Sequence[dict[str, Any]]:
        return self._rows[index]

    def where(self, index: int) -> str:
        if self._lines is None:
            return super().where(index)
        return f"{self.source}:{self._lines[index]}"

    def digest(self) -> tuple[DigestKind, str]:
        return "sha256", file_sha256(self.path)


class ArrowRows(Rows):
    """Rows of a `datasets.Dataset`, left in its Arrow table until asked for."""

    def __init__(self, dataset: Dataset, source: str, origin: Path | None) -> None:
        # Rows as Python values, whatever format (torch, numpy) the dataset was saved with.
        self.dataset, self.source, self._origin = dataset.with_format(None), source, origin
        self.fingerprint = str(dataset._fingerprint)  # as loaded: with_format makes a new one

    def __len__(self) -> int:
        return len(self.dataset)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | Sequence[dict[str, Any]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {self.source}, which has {len(self)}")
        return _present(self.dataset[index])

    def records(self) -> Iterator[tuple[int, dict[str, Any]]]:
        index = 0
        for batch in self.dataset.iter(batch_size=BATCH_ROWS):
            columns = list(batch)
            for values in zip(*(batch[c] for c in columns), strict=True):
                yield index, _present(dict(zip(columns, values, strict=True)))
                index += 1

    def digest(self) -> tuple[DigestKind, str]:
        if self._origin is None:  # from the hub: what `datasets` says identifies its content
            return "fingerprint", self.fingerprint
        if self._origin.is_dir():
            return "sha256", directory_sha256(self._origin)
        return "sha256", file_sha256(self._origin)


def _present(row: dict[str, Any]) -> dict[str, Any]:
    """A row without its null fields: Arrow has no missing field, only a null one."""
    return {key: value for key, value in row.items() if value is not None}


def open_rows(spec: str | Path, *, split: str | None = None, what: str = "data file") -> Rows:
    """The rows at `spec` (see the module docstring); `what` names it in errors ("SFT
    dataset"). `split` picks a DatasetDict's split, as `@SPLIT` does."""
    text = str(spec)
    if text.startswith(HUB_PREFIX):
        name, config, at = parse_hub_id(text)
        return _hub_rows(text, name, config, _one_split(text, at, split), what)
    path = Path(spec)
    if not path.exists() and "@" in path.name:  # DIR@SPLIT
        stem, _, at = path.name.rpartition("@")
        if (path.parent / stem).exists():
            path, split = path.parent / stem, _one_split(text, at, split)
    if not path.exists():
        raise FileNotFoundError(f"{what} {str(spec)!r} does not exist")
    if path.is_dir():
        return _saved_rows(path, split, what)
    if split is not None:
        raise ValueError(
            f"{what} {text!r}: split {split!r} is for a datasets.save_to_disk directory or a "
            f"hub id; {str(path)!r} is a file"
        )
    suffix = path.suffix.lower()
    if suffix in ARROW_FORMATS:
        return _file_rows(path, suffix, what)
    if suffix == ".json":
        return _json_rows(path)
    return _jsonl_rows(path)


def _one_split(spec: str, at: str | None, option: str | None) -> str | None:
    if at is not None and option is not None and at != option:
        raise ValueError(f"{spec!r} names split {at!r}, and the split option {option!r}")
    return at or option


def json_object(line: str) -> dict[str, Any]:
    """One JSONL line's object, or a ValueError saying what the line is instead."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError(f"each line must be a JSON object, got {type(record).__name__}")
    return record


def _jsonl_rows(path: Path) -> JsonRows:
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json_object(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
            lines.append(number)
    return JsonRows(path, rows, lines)


def _json_rows(path: Path) -> JsonRows:
    """A list of objects (rows numbered from 1), else one object per line (JSONL)."""
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        return _jsonl_rows(path)
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON: {exc}") from None
    for index, value in enumerate(values):
        if not isinstance(value, dict):
            raise ValueError(
                f"{path}, row {index + 1}: each row must be a JSON object, got "
                f"{type(value).__name__}"
            )
    return JsonRows(path, values, None)


def _datasets(what: str, spec: str, kind: str) -> Any:
    """The `datasets` module, or an ImportError that says how to install it."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"{what} {spec!r} is {kind}; posttrain reads it with the datasets library: "
            f"{EXTRA} (JSONL and JSON need nothing more)"
        ) from None
    return datasets


def _file_rows(path: Path, suffix: str, what: str) -> ArrowRows:
    kind = ARROW_FORMATS[suffix]
    datasets = _datasets(what, str(path), f"a {kind} file")
    if kind == "Arrow":  # already what `datasets` keeps: memory-map it as it is
        return ArrowRows(datasets.Dataset.from_file(str(path)), str(path), path)
    if kind == "Parquet":  # converted once into the datasets cache, then memory-mapped
        return ArrowRows(datasets.Dataset.from_parquet(str(path)), str(path), path)
    with path.open(newline="", encoding="utf-8-sig") as f:  # without a BOM, as pandas reads it
        reader = csv.reader(f)
        header, first = next(reader, None), next(reader, None)
    if not header or first is None:  # no rows (datasets would refuse a file of no data)
        return ArrowRows(datasets.Dataset.from_dict({}), str(path), path)
    # Every column as text, and only an empty cell missing: pandas would otherwise read "007"
    # as 7 and "NA" or "None" as missing, which would change answers.
    text = datasets.Features({name: datasets.Value("string") for name in header})
    dataset = datasets.Dataset.from_csv(
        str(path), features=text, keep_default_na=False, na_values=[""]
    )
    return ArrowRows(dataset, str(path), path)


def _saved_rows(path: Path, split: str | None, what: str) -> ArrowRows:
    if not (path / "dataset_dict.json").is_file() and not (path / "state.json").is_file():
        raise ValueError(
            f"{what} {str(path)!r} is a directory, but not one written by "
            "datasets.save_to_disk (it has no dataset_dict.json or state.json); a data file "
            f"is one of: {FORMATS}"
        )
    datasets = _datasets(what, str(path), "a datasets.save_to_disk directory")
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.Dataset):
        if split is not None:
            raise ValueError(
                f"{what} {str(path)!r} holds one Dataset, not a DatasetDict: it has no split "
                f"{split!r}; name the directory without @{split}"
            )
        return ArrowRows(loaded, str(path), path)
    chosen = _choose_split(str(path), list(loaded), split, what)
    return ArrowRows(loaded[chosen], f"{path}@{chosen}", path)


def _choose_split(source: str, splits: list[str], split: str | None, what: str) -> str:
    if split is None and len(splits) == 1:
        return splits[0]
    if split in splits:
        return split
    has = ", ".join(map(repr, splits))
    if split is None:
        raise ValueError(f"{what} {source!r} has splits {has}: name one ({source}@{splits[0]})")
    raise ValueError(f"{what} {source!r} has no split {split!r}; it has {has}")


def _hub_rows(spec: str, name: str, config: str | None, split: str | None, what: str) -> ArrowRows:
    datasets = _datasets(what, spec, "a Hugging Face hub dataset")
    try:
        loaded = datasets.load_dataset(name, config, split=split)
    except ValueError as exc:  # an unknown split or config
        raise ValueError(f"{what} {spec!r}: {exc}") from None
    except OSError as exc:  # ConnectionError, and datasets' DatasetNotFoundError
        offline = [name for name in OFFLINE_VARIABLES if os.environ.get(name, "0") not in ("", "0")]
        mode = f"offline ({offline[0]} is set)" if offline else "from here"
        arguments = ", ".join(
            [
                repr(name),
                *([repr(config)] if config else []),
                *([f"split={split!r}"] if split else []),
            ]
        )
        raise ValueError(
            f"{what} {spec!r}: the Hugging Face hub dataset {name!r} cannot be loaded {mode}: {exc}. "
            "Without the hub (HF_DATASETS_OFFLINE=1, or no network) a hub id loads only from "
            "the datasets cache. Save it on a machine with network: "
            f"datasets.load_dataset({arguments}).save_to_disk(DIR); then copy DIR here and set "
            "this option to DIR (DIR@SPLIT for a DatasetDict)"
        ) from None
    if isinstance(loaded, datasets.Dataset):
        return ArrowRows(loaded, spec, None)
    chosen = _choose_split(spec, list(loaded), split, what)
    return ArrowRows(loaded[chosen], f"{spec}@{chosen}", None)


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in blocks (a large file is never whole in memory)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def directory_sha256(path: Path) -> str:
    """sha256 over a directory's files: each one's relative path and the sha256 of its bytes."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path).as_posix()}\0{file_sha256(file)}\n".encode())
    return digest.hexdigest()
