"""ServerConfig: everything `posttrain serve` is started with."""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

KEY_PREFIX = "tml-"
# Download URLs of external weights (`tinker_external`): their token is the credential.
EXTERNAL_FILES = "/api/v1/external_weights_files/"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def owner_of(api_key: str) -> str:
    """The identity rows are stored under: a hash, so the database never holds a key."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ServerConfig:
    """`base_model` is the served name (as given to --base-model); `model_path` what loads it."""

    base_model: str
    model_path: str
    db_path: Path
    storage_dir: Path
    api_keys: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 64 * 1024 * 1024
    lora_rank_max: int = 256
    seq_gap_timeout: float = 30.0  # a model waits this long for a missing seq_id
    poll_timeout: float = 25.0  # retrieve_future holds this long before try_again
    # Sampling models kept loaded: each is an adapter on the shared base (models.shared_base),
    # so a cache as large as the clients one serves costs little.
    sampler_cache_size: int = 16
    # LoRA training clients and sampling models in memory at most (`server.residency`); idle
    # ones beyond it are spilled to disk. None: no limit.
    max_resident_adapters: int | None = None
    # A session without a heartbeat for this long is finished and its models unloaded (the SDK
    # beats every 10 s and warns after 120 s without one).
    session_timeout: float = 300.0
    device: str = "cpu"
    # Every training model's passes pack datums into rows (`engine.packing`): the Tinker wire
    # cannot ask for it per call, so the server decides for all its models.
    packing: bool = False
    aliases: tuple[str, ...] = field(default=())  # other names accepted for the base model

    def __post_init__(self) -> None:
        for key in self.api_keys:
            if not key.startswith(KEY_PREFIX):
                raise ValueError(
                    f"API keys must start with {KEY_PREFIX!r} (the tinker SDK refuses others)"
                )
        if not self.api_keys and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on non-loopback host {self.host!r} without an API key: "
                "pass --api-key tml-... (or bind 127.0.0.1)"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.lora_rank_max < 1:
            raise ValueError(f"lora_rank_max must be >= 1, got {self.lora_rank_max}")
        if not self.seq_gap_timeout > 0 or not self.poll_timeout > 0:
            raise ValueError("seq_gap_timeout and poll_timeout must be > 0")
        if not self.session_timeout > 0:
            raise ValueError(f"session_timeout must be > 0, got {self.session_timeout}")
        if self.sampler_cache_size < 1:
            raise ValueError(f"sampler_cache_size must be >= 1, got {self.sampler_cache_size}")
        if self.max_resident_adapters is not None and self.max_resident_adapters < 1:
            raise ValueError(
                f"--max-resident-adapters must be >= 1 (one request needs one adapter in "
                f"memory), got {self.max_resident_adapters}; leave it out for no limit"
            )

    def serves(self, name: str) -> bool:
        return name == self.base_model or name in self.aliases


def model_config_int(model_path: str, field: str) -> int | None:
    """An integer field of the served model's config (`hidden_size`, `max_position_embeddings`),
    or None where it has no config or no such integer."""
    from transformers import AutoConfig

    try:
        value = getattr(AutoConfig.from_pretrained(model_path), field, None)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None
