"""One forward of a PEFT LoRA model (the host) where each batch row uses its own adapter.

The adapters of several LoRA models of one base model (and the base model itself, "no
adapter") are stacked per wrapped linear layer, zero-padded to the largest rank:

    A_SRI [slots, r_max, in]    B_SOR [slots, out, r_max]    scale_S = alpha / rank per slot

and each host `lora.Linear` computes, for row b with slot s_b,

    y_b = base_layer(x_b) + scale_{s_b} * (x_b A_{s_b}^T) B_{s_b}^T

with A and B gathered per row and multiplied with `bmm`: the batched gather-matmul of S-LoRA
and Punica ("bgmv"), written in torch. A slot's padding rows of A and columns of B are zero,
so they add exact zeros to the sum over the rank; the base-model slot is all zeros. As PEFT
does, x is cast to the adapters' dtype (float32 on a bf16 base) and the sum back to the base
layer's dtype.

Which models may share a batch (`MultiLora` refuses the others with a ValueError):
- the same base weights as the host: every non-LoRA parameter, by name, is the host's own
  tensor (same storage) or equal to it. The check compares values once per (host, model) pair
  and keeps the answer while neither model's base tensors change (their version counters);
- the same LoRA target modules as the host (a base model has none: its slot adds nothing);
- plain LoRA: no dropout, no DoRA, no LoRA bias, no `modules_to_save`, one active adapter,
  not merged.

LoRA on the input embedding (the tinker SDK's `train_unembed=True` on a model that ties its
unembedding, as Qwen2.5-0.5B and SmolLM2 do: one adapter on the shared matrix,
`models.load.apply_lora`) adds, for row b with slot s_b and token ids x_b,

    e_b = embedding(x_b) + scale_{s_b} * A_{s_b}^T[x_b] B_{s_b}^T

a lookup in each slot's own A, done slot by slot for the rows of that slot (an embedding is one
lookup per forward; stacking the vocabulary-wide A of every slot would copy them all). The tied
output projection's factors are views of the embedding adapter's, and gather as any linear
layer's do.

A `MultiLora` stacks the adapters as they are when it is built: build one per batch.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peft.tuners.lora import Embedding as LoraEmbedding
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from peft.utils.other import ModulesToSaveWrapper
from torch import nn
from torch.nn import functional as F

_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class _Adapter:
    """One model's factors of one layer: A [rank, in], B [out, rank], scale alpha / rank."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float


@dataclass(frozen=True)
class _Stack:
    """One host layer's adapters of every slot, zero-padded to the largest rank."""

    A_SRI: torch.Tensor
    B_SOR: torch.Tensor
    scale_S: torch.Tensor


class MultiLora:
    """Per-row adapters for forwards of `host`: slot i is `models[i]` (the host may be one of
    them). `use(slot_B)` sets the rows' slots; forwards inside `patched()` apply them."""

    def __init__(self, host: nn.Module, models: Sequence[nn.Module]) -> None:
        if not models:
            raise ValueError("MultiLora needs at least one model (slot)")
        self.host = host
        self.layers = lora_layers(host, "the host")
        if not self.layers:
            raise ValueError("the host model has no LoRA layers: give a PEFT LoRA model")
        device = next(host.parameters()).device
        per_slot: list[dict[str, _Adapter] | None] = []
        for i, model in enumerate(models):
            name = f"models[{i}]"
            layers = lora_layers(model, name)
            if layers and set(layers) != set(self.layers):
                missing = sorted(set(self.layers) - set(layers))[:3]
                extra = sorted(set(layers) - set(self.layers))[:3]
                raise ValueError(
                    f"{name} adapts other layers than the host (missing {missing}, extra "
                    f"{extra}): only models with the host's LoRA target modules share a batch"
                )
            check_same_base(host, model, name)
            per_slot.append(
                {k: _adapter(m, f"{name} layer {k}") for k, m in layers.items()} or None
            )
        dtypes = {a.A.dtype for slot in per_slot if slot for a in slot.values()}
        if len(dtypes) > 1:
            raise ValueError(
                f"the models' adapters have different dtypes {sorted(map(str, dtypes))}"
            )
        self.slots = len(models)
        self._per_slot = per_slot
        self._device = device
        self._slot_B: torch.Tensor | None = None

    def use(self, slot_B: torch.Tensor) -> None:
        """The slot of each row of the next forwards (a long tensor, one entry per row)."""
        if slot_B.numel() and not 0 <= int(slot_B.min()) <= int(slot_B.max()) < self.slots:
            raise ValueError(f"slots must be in [0, {self.slots}), got {slot_B.tolist()}")
        self._slot_B = slot_B.to(self._device)

    @contextlib.contextmanager
    def patched(self) -> Iterator[MultiLora]:
        """Inside, every host LoRA layer computes the per-row sum of the module docstring.

        The stacks are built here, under the caller's grad mode: with gradients on, they are
        differentiable functions of each model's own A and B Parameters.
        """
        forwards = {
            name: self._embedding_forward(layer, name)
            if isinstance(layer, LoraEmbedding)
            else self._forward(layer, self._stack(name))
            for name, layer in self.layers.items()
        }
        with _PATCH_LOCK:
            for name, layer in self.layers.items():
                if "forward" in vars(layer):
                    raise RuntimeError(f"host layer {name} is already patched by a MultiLora")
                layer.forward = forwards[name]
            try:
                yield self
            finally:
                for layer in self.layers.values():
                    del layer.forward

    def _stack(self, name: str) -> _Stack:
        adapters = [slot[name] if slot else None for slot in self._per_slot]
        real = [a for a in adapters if a is not None]
        base = self.layers[name].get_base_layer()
        out, inp = int(getattr(base, "out_features")), int(getattr(base, "in_features"))  # noqa: B009
        dtype = real[0].A.dtype if real else torch.float32
        r_max = max((a.A.shape[0] for a in real), default=1)
        A_parts: list[torch.Tensor] = []
        B_parts: list[torch.Tensor] = []
        for a in adapters:
            if a is None:
                A_parts.append(torch.zeros(r_max, inp, dtype=dtype, device=self._device))
                B_parts.append(torch.zeros(out, r_max, dtype=dtype, device=self._device))
                continue
            pad = r_max - a.A.shape[0]
            A_parts.append(nn.functional.pad(a.A, (0, 0, 0, pad)))
            B_parts.append(nn.functional.pad(a.B, (0, pad)))
        scales = [0.0 if a is None else a.scale for a in adapters]
        return _Stack(
            torch.stack(A_parts),
            torch.stack(B_parts),
            torch.tensor(scales, dtype=dtype, device=self._device),
        )

    def _rows(self, rows: int) -> torch.Tensor:
        """The slots of the forward's `rows` rows, as `use` set them."""
        slot_B = self._slot_B
        if slot_B is None or slot_B.numel() != rows:
            raise RuntimeError(
                f"MultiLora: {rows} rows but slots for "
                f"{None if slot_B is None else slot_B.numel()}; call use() before the forward"
            )
        return slot_B

    def _embedding_forward(self, layer: LoraEmbedding, name: str) -> Callable[..., torch.Tensor]:
        """The embedding lookup plus each row's own adapter, slot by slot (module doc)."""
        base_layer = layer.get_base_layer()
        padding_idx = getattr(base_layer, "padding_idx", None)
        adapters = [slot[name] if slot else None for slot in self._per_slot]

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = base_layer(x, *args, **kwargs)
            slot_B = self._rows(x.shape[0])
            # As PEFT adds it: in the adapters' dtype, cast back to the embedding's at the end.
            dtypes = [a.A.dtype for a in adapters if a is not None]
            out = result.to(torch.promote_types(result.dtype, dtypes[0])) if dtypes else result
            for slot in slot_B.unique().tolist():
                adapter = adapters[slot]
                if adapter is None:
                    continue
                rows = (slot_B == slot).nonzero().squeeze(1)
                # As PEFT looks it up; padding_idx matters to gradients only.
                after_A = F.embedding(x[rows], adapter.A.T, padding_idx=padding_idx)
                delta = (after_A @ adapter.B.T) * adapter.scale
                out = out.index_add(0, rows, delta.to(out.dtype))
            return out.to(result.dtype)

        return forward

    def _forward(self, layer: LoraLinear, stack: _Stack) -> Callable[..., torch.Tensor]:
        base_layer = layer.get_base_layer()

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = base_layer(x, *args, **kwargs)
            slot_B = self._rows(x.shape[0])
            # [B, T, in] (a [B, in] input is T = 1), in the adapters' dtype as PEFT casts it.
            x_BTI = x.to(stack.A_SRI.dtype).reshape(x.shape[0], -1, x.shape[-1])
            # The gather: each row's own factors, [B, r_max, in] and [B, out, r_max].
            A_BRI = stack.A_SRI[slot_B]
            B_BOR = stack.B_SOR[slot_B]
            h_BTR = torch.bmm(x_BTI, A_BRI.transpose(1, 2))
            delta_BTO = (
                torch.bmm(h_BTR, B_BOR.transpose(1, 2)) * stack.scale_S[slot_B][:, None, None]
            )
            return (result + delta_BTO.reshape(result.shape)).to(result.dtype)

        return forward


# Patching assigns instance attributes on shared host layers; one MultiLora at a time per host
# is what the sampler needs, and the lock makes a second one wait rather than interleave.
_PATCH_LOCK = threading.RLock()


def lora_layers(model: nn.Module, name: str) -> dict[str, LoraLinear | LoraEmbedding]:
    """`model`'s LoRA layers (linear and embedding) by module name (as named in the PEFT
    tree); a ValueError for what a batch cannot gather (the module docstring)."""
    layers: dict[str, LoraLinear | LoraEmbedding] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            raise ValueError(
                f"{name} has modules_to_save ({module_name}): whole trained modules of its "
                "own, which a shared batch cannot give it"
            )
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, LoraLinear | LoraEmbedding):
            raise ValueError(
                f"{name} has LoRA on a {type(module).__name__} ({module_name}); only LoRA on "
                "linear and embedding layers is batched across adapters"
            )
        layers[module_name] = module
    return layers


def _adapter(layer: LoraLinear | LoraEmbedding, name: str) -> _Adapter:
    """The layer's factors as A [rank, in] and B [out, rank] (an embedding's: A [rank, vocab],
    B [dim, rank], as PEFT stores them)."""
    active = [a for a in layer.active_adapters if a in layer.scaling]
    if len(active) != 1:
        raise ValueError(f"{name} has {len(active)} active adapters; batching needs exactly one")
    if layer.merged or layer.disable_adapters:
        raise ValueError(f"{name} has its adapter merged or disabled; batching needs it live")
    key = active[0]
    dropout = layer.lora_dropout[key] if key in layer.lora_dropout else None  # noqa: SIM401 - a ModuleDict has no get
    if isinstance(dropout, nn.Dropout) and dropout.p > 0:
        raise ValueError(f"{name} uses LoRA dropout {dropout.p}; batching needs dropout 0")
    if layer.use_dora.get(key, False) or key in getattr(layer, "lora_variant", {}):
        raise ValueError(f"{name} uses DoRA (or another LoRA variant); batching needs plain LoRA")
    if isinstance(layer, LoraEmbedding):
        if layer._get_embed_scale() is not None:
            raise ValueError(f"{name} scales its embedding (Gemma's); batching does not")
        A, B = layer.lora_embedding_A[key], layer.lora_embedding_B[key]
        return _Adapter(A, B, float(layer.scaling[key]))
    # A linear factor, or a view of the embedding adapter's (a tied unembedding's factors,
    # `models.load._TransposedFactor`): either has a 2-D `weight`.
    lora_A, lora_B = layer.lora_A[key], layer.lora_B[key]
    A, B = getattr(lora_A, "weight", None), getattr(lora_B, "weight", None)
    if not isinstance(A, torch.Tensor) or not isinstance(B, torch.Tensor) or A.dim() != 2:
        raise ValueError(f"{name} has LoRA factors that are not linear layers")
    if getattr(lora_B, "bias", None) is not None:
        raise ValueError(f"{name} has a LoRA bias; batching needs bias-free factors")
    return _Adapter(A, B, float(layer.scaling[key]))


def base_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The non-LoRA parameters by their name in the unwrapped model (PEFT's prefix and
    `base_layer` segments removed), so a PEFT model's and a plain model's names match."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        plain = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
        out[plain] = param
    return out


# (host, model) -> the (storage, version) of their base tensors when found equal.
_VERIFIED: weakref.WeakKeyDictionary[nn.Module, weakref.WeakKeyDictionary[nn.Module, object]] = (
    weakref.WeakKeyDictionary()
)
_VERIFIED_LOCK = threading.Lock()


def check_same_base(host: nn.Module, model: nn.Module, name: str) -> None:
    """A ValueError unless `model`'s base parameters are the host's: the same tensors, or
    equal ones (the second compare of a pair whose tensors did not change is free)."""
    if model is host:
        return
    mine, theirs = base_parameters(host), base_parameters(model)
    stamp = tuple(_stamp(t) for t in (*mine.values(), *theirs.values()))
    with _VERIFIED_LOCK:
        if _VERIFIED.get(host, {}).get(model) == stamp:
            return
    if set(mine) != set(theirs):
        diff = sorted(set(mine) ^ set(theirs))[:3]
        raise ValueError(f"{name} is not a model of the host's base: parameters differ ({diff})")
    for key, a in mine.items():
        b = theirs[key]
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            raise ValueError(
                f"{name} is not a model of the host's base: {key} is {tuple(b.shape)} "
                f"{b.dtype} on {b.device}, the host's {tuple(a.shape)} {a.dtype} on {a.device}"
            )
        same_storage = a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
        if not same_storage and not torch.equal(a, b):
            raise ValueError(
                f"{name} is not a model of the host's base: its {key} differs from the host's"
            )
    with _VERIFIED_LOCK:
        _VERIFIED.setdefault(host, weakref.WeakKeyDictionary())[model] = stamp


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    # `_version` counts in-place writes (an optimizer step, a load): a changed base shows.
    return (t.data_ptr(), t._version)
