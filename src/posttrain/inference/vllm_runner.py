"""vLLM inside the engine worker process (`host.py`): sampling on token ids, weight reloads.

The offline `LLM` runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): on a 2-core CPU
it starts in about 2 s and samples 1.3-2.2x as fast as vLLM's multiprocess layout (measured in
shared/reference/vllm-cpu-notes.md). Logprobs follow posttrain's convention,
log_softmax(logits / temperature) over the full vocabulary (`processed_logprobs`), which holds
only with top-k, top-p, min-p and penalties off; the parent refuses them (`engines.py`).

It starts on the base model and takes each sync's update (`updates.py`) without a reload: a
LoRA adapter is added under a new name, `posttrain-v<N>` with a new id (vLLM keys its prefix
cache by adapter, so a name is never reused), before any sample uses it (an adapter vLLM refuses
raises at `add_lora`, where at `generate` it would kill the engine); the oldest are removed
beyond `lora_slots`. Every other tensor is written into the model's weights in place.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from posttrain.inference.updates import BaseWeights, resolve_update
from posttrain.types import SamplingParams

# The ranks vLLM's LoRA manager accepts as max_lora_rank.
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMRunner:
    def __init__(self, options: dict[str, Any]) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        try:
            from vllm import LLM  # pyright: ignore[reportMissingImports]  # its own venv
        except ImportError as exc:
            from posttrain.inference.vllm_install import install_hint

            raise ImportError(
                f"vLLM is not importable by {sys.executable} ({exc}). Install it in a venv of "
                f"its own: {install_hint()}"
            ) from exc

        lora_slots = int(options.get("lora_slots") or 0)
        lora: dict[str, Any] = {}
        if lora_slots:
            rank = int(options["lora_rank"])
            lora = {
                "enable_lora": True,
                "max_lora_rank": next((r for r in _VLLM_LORA_RANKS if r >= rank), rank),
                "max_loras": lora_slots,
                "max_cpu_loras": lora_slots,
            }
        self.llm = LLM(
            model=options["model_dir"],
            dtype=options["dtype"],
            max_model_len=options["max_model_len"],
            enforce_eager=True,  # torch.compile adds 25-90 s of start-up on a CPU
            kv_cache_memory_bytes=int(options["kv_cache_mb"]) * 2**20,
            logprobs_mode="processed_logprobs",
            seed=0,
            **lora,
        )
        self.max_model_len = int(options["max_model_len"])
        self.base = BaseWeights(Path(options["model_dir"]))
        self.lora_slots = lora_slots
        self.adapters: list[Any] = []  # LoRARequests loaded, oldest first; the last one samples
        self._next_id = 1
        self._held: dict[str, torch.Tensor] = {}  # fused layers' parts, see _write_in_place

    def sample(self, request: dict[str, Any]) -> list[list[dict[str, Any]]]:
        """posttrain's SamplingParams (`params`, refused by the parent where vLLM cannot
        match them) in vLLM's terms, each prompt seeded by its own `seeds` entry."""
        from vllm import SamplingParams as VLLMParams  # pyright: ignore[reportMissingImports]

        prompts: list[list[int]] = request["prompts"]
        seeds: list[int | None] = request["seeds"]
        asked = SamplingParams(**request["params"])
        stop_strings, stop_tokens = list(asked.stop_strings()), list(asked.stop_tokens())
        params = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            room = self.max_model_len - len(prompt)
            if room < 1:
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens leaves no room in max_model_len "
                    f"{self.max_model_len}"
                )
            max_tokens = asked.max_tokens
            params.append(
                VLLMParams(
                    n=request["n"],
                    temperature=asked.temperature,
                    max_tokens=room if max_tokens is None else min(max_tokens, room),
                    logprobs=0,  # the sampled token's own logprob only
                    detokenize=bool(stop_strings),
                    seed=seed,
                    ignore_eos=asked.stop is not None,  # an explicit stop replaces EOS
                    stop_token_ids=stop_tokens or None,
                    stop=stop_strings or None,
                    include_stop_str_in_output=True,
                )
            )
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            params,
            use_tqdm=False,
            lora_request=self.adapters[-1] if self.adapters else None,
        )
        return [[_sequence(c) for c in out.outputs] for out in outputs]

    def load(self, path: str) -> None:
        # A whole reload replaces what updates wrote in place, and resets vLLM's LoRA state.
        self._held.clear()
        self.adapters.clear()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        self.llm.reset_prefix_cache()  # cached prompt KV came from the old weights

    def update(self, request: dict[str, Any]) -> list[str]:
        """Version N's update: its adapter added as `posttrain-v<N>`, its other tensors
        written in place; without LoRA slots, the adapter is merged in place as well."""
        if request["kind"] == "model":
            self.load(request["path"])
            return []
        adapter = request.get("adapter")
        load_adapter = adapter is not None and self.lora_slots > 0
        tensors = resolve_update(
            self.base,
            adapter=None if adapter is None else Path(adapter),
            tensors=None if request.get("tensors") is None else Path(request["tensors"]),
            lora_scale=request.get("lora_scale"),
            merge_adapter=not load_adapter,
        )
        if tensors:
            held, base = self._held, self.base
            self.llm.collective_rpc(
                lambda worker: _write_in_place(worker.model_runner.model, tensors, held, base)
            )
            self.llm.reset_prefix_cache()  # cached prompt KV came from the old weights
        if load_adapter:
            self._add_adapter(int(request["version"]), str(adapter))
        return [a.lora_name for a in self.adapters]

    def _add_adapter(self, version: int, path: str) -> None:
        from vllm.lora.request import LoRARequest  # pyright: ignore[reportMissingImports]

        lora = LoRARequest(f"posttrain-v{version}-{self._next_id}", self._next_id, path)
        self._next_id += 1
        engine = self.llm.llm_engine
        engine.add_lora(lora)  # raises here for an adapter vLLM cannot carry
        self.adapters.append(lora)
        # Requests run one at a time here: none still uses an adapter older than the newest.
        while len(self.adapters) > self.lora_slots:
            engine.remove_lora(self.adapters.pop(0).lora_int_id)


def _sequence(completion: Any) -> dict[str, Any]:
    tokens = list(completion.token_ids)
    logprobs = [
        entry[token].logprob for entry, token in zip(completion.logprobs, tokens, strict=True)
    ]
    reason = "length" if completion.finish_reason == "length" else "stop"
    return {"tokens": tokens, "logprobs": logprobs, "stop_reason": reason}


def _write_in_place(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    held: dict[str, torch.Tensor],
    base: BaseWeights,
) -> None:
    """Write whole tensors (Hugging Face names) into vLLM's model in place.

        vLLM fuses q/k/v and gate/up into one layer (`packed_modules_mapping`): a part goes to its
        rows. On a CPU vLLM packs each linear layer's weight for oneDNN and drops the plain one, so
        such a layer is rebuilt whole and packed again (`process_weights_after_loading`): the parts
        a fused layer's update lacks come from `held` (the last written), else the base model; `held`
    costs one more copy of the fused layers that were ever written.
        Embedding tables are padded to a multiple of 64 rows: the first rows are written.
    """
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    touched: dict[tuple[str, str], list[tuple[int | None, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        module_name, _, param_name = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        fused = next((f for f, parts in packed.items() if leaf in parts), None)
        if fused is None:
            touched.setdefault((module_name, param_name), []).append((None, tensor))
        else:
            target = f"{parent}.{fused}" if parent else fused
            touched.setdefault((target, param_name), []).append((packed[fused].index(leaf), tensor))
    with torch.no_grad():
        for (module_name, param_name), parts in touched.items():
            module = _unwrap(model.get_submodule(module_name))
            param = getattr(module, param_name)
            if parts[0][0] is None:
                whole = parts[0][1]
            else:
                whole = _fused(module_name, param_name, parts, packed, held, base, param.dtype)
            whole = whole.to(param.dtype)
            if param.numel() == 0:  # the CPU gemm dropped it when it packed the weight
                setattr(module, param_name, torch.nn.Parameter(whole, requires_grad=False))
            else:
                param.data[: whole.shape[0]].copy_(whole)
            method = getattr(module, "quant_method", None)
            if method is not None and param_name == "weight":
                method.process_weights_after_loading(module)


def _fused(
    module_name: str,
    param_name: str,
    parts: list[tuple[int | None, torch.Tensor]],
    packed: dict[str, list[str]],
    held: dict[str, torch.Tensor],
    base: BaseWeights,
    dtype: torch.dtype,
) -> torch.Tensor:
    parent, _, fused = module_name.rpartition(".")
    given = {i: t for i, t in parts}
    pieces = []
    for i, leaf in enumerate(packed[fused]):
        name = f"{parent}.{leaf}.{param_name}"
        if i in given:
            held[name] = given[i].to(dtype)
        elif name not in held:
            held[name] = base.get(name).to(dtype)  # never written: still the base weight
        pieces.append(held[name])
    return torch.cat(pieces)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """A LoRA-wrapped layer's own layer (vLLM's `BaseLayerWithLoRA.base_layer`)."""
    return getattr(module, "base_layer", module)
