"""`OpenAIEngine`: sampling through an OpenAI-compatible server by URL (vLLM, SGLang,
`posttrain serve`).

posttrain trains on the exact token ids sampled, so the server must return them (vLLM's
`token_ids` on each choice, or `return_tokens_as_token_ids`' "token_id:N" tokens) and each
token's logprob; `start` probes for both with a one-token request of the same shape as every
later one. Prompts go as token ids, one request per prompt seeded by `prompt_seed`, so a prompt
samples the same tokens whatever else is in the batch; the requests run concurrently.

Logprobs must follow posttrain's convention, log_softmax(logits / temperature) over the full
vocabulary: vLLM gives it with `--logprobs-mode processed_logprobs` (its default,
raw_logprobs, ignores the temperature), and top-k / top-p are refused, as by the vllm engine.
Every sampling field is sent, at neutral values where posttrain has none, so that no server
default (vLLM takes top_k, top_p, repetition_penalty from the model's generation_config)
changes the distribution.

Weights (`[inference] sync`), each from a directory the server must see (it runs on this
machine): "reload" loads each whole, LoRA-merged snapshot through vLLM's dev-mode endpoints
(`VLLM_SERVER_DEV_MODE=1`). "lora" loads the LoRA alone, as a PEFT adapter, through
`/v1/load_lora_adapter` (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, `--enable-lora`) under a new
name per version, `<model>-posttrain-v<N>`, which requests then name as their model: vLLM keys
its prefix cache by adapter name, so no request reuses prompt KV of an older adapter (vLLM
#42125); `served_adapters` unloads old names once no request in flight uses them. "auto"
takes "lora" where the adapter fits vLLM's LoRA and the server loads it, else "reload". The
engine session loads the model's weights once at registration, so a server that cannot take
them is refused before any work. "none" samples the server's own fixed weights: training goes
explicitly off-policy, and the session never asks it for new weights.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.data.seeds import prompt_seed
from posttrain.inference.adapter_export import discard
from posttrain.inference.config import InferenceConfig
from posttrain.inference.engines import DISTRIBUTION_FIELDS, ENGINES
from posttrain.inference.protocol import EngineCapabilities, WeightSnapshot
from posttrain.inference.served_adapters import ServedAdapters
from posttrain.types import SampledSequence, SampleResponse, SamplingParams

if TYPE_CHECKING:
    import httpx

Json = dict[str, Any]

# Ids every vocabulary has; the probe's prompt.
PROBE_PROMPT = [1, 2, 3]
TOKEN_ID_PREFIX = "token_id:"
# The values vLLM takes for --max-lora-rank (`vllm.config.lora.MaxLoRARanks`).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class OpenAIServerError(RuntimeError):
    """The server answered with an error (`status`), could not be reached (None), or answered
    without what posttrain needs."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class OpenAIEngine:
    """Samples from the model an OpenAI-compatible server at `config.url` serves; with LoRA
    sync, at most `keep` adapter versions loaded at once (max_off_policy_steps + 2 lets every
    request of an async run finish on the adapter it began with)."""

    name = "openai"

    def __init__(self, config: InferenceConfig, *, version: int = 0, keep: int = 3) -> None:
        if not config.url:
            raise ValueError("[inference] engine = 'openai' needs url = 'http://HOST:PORT/v1'")
        if keep < 2:
            raise ValueError(f"keep must be >= 2 adapter versions, got {keep}")
        self.config = config
        self.keep = keep
        self.url = config.url.rstrip("/")
        self.root = self.url.removesuffix("/v1")
        self.model = config.model  # None until `start` asks the server
        # Until `start` probes the server, nothing is known to come back.
        self.capabilities = EngineCapabilities(
            returns_token_ids=False,
            returns_logprobs=False,
            weight_sync="none" if config.fixed_policy else "full",
            own_process=True,
            provides_token_entropies=False,
        )
        self._version = version
        self._logprobs_field = 0  # 1 where a server refuses 0 (the sampled token alone)
        self._http: httpx.AsyncClient | None = None
        self._adapters: ServedAdapters | None = None  # made at the first adapter sync

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        """Resolve the model name and probe what the server returns."""
        _require_httpx()
        import httpx

        key = self.config.api_key
        self._http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {key}"} if key else {},
            timeout=httpx.Timeout(30.0, read=None),  # a long generation is no failure
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        try:
            if self.model is None:
                self.model = await self._first_model()
            choice = await self._probe()
        except BaseException:
            await self.close()
            raise
        has_ids = _token_ids(choice) is not None
        has_logprobs = _logprobs(choice) is not None
        if not has_ids:
            await self.close()
            raise OpenAIServerError(
                f"{self.url} returns no token ids (vLLM's `return_token_ids`, or "
                "`return_tokens_as_token_ids`): posttrain trains on the exact tokens sampled, "
                "so it cannot sample through this server"
            )
        if not has_logprobs and not self.config.allow_training_without_logprobs:
            await self.close()
            raise OpenAIServerError(
                f"{self.url} returns no logprobs of the sampled tokens, which the RL losses "
                "need; set [inference] allow_training_without_logprobs = true to train on its "
                "samples anyway (SampledSequence.logprobs = None)"
            )
        self.capabilities = replace(
            self.capabilities, returns_token_ids=True, returns_logprobs=has_logprobs
        )

    async def sample_many(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[SampleResponse]:
        _check_params(params)
        adapter = self._adapters.acquire() if self._adapters is not None else None
        model = adapter.name if adapter is not None else self.model
        version = adapter.version if adapter is not None else self._version
        bodies = [
            self._body(prompt, num_samples, params, prompt_seed(params.seed, i), model)
            for i, prompt in enumerate(prompts)
        ]
        try:
            rows = await asyncio.gather(*(self._choices(body, num_samples) for body in bodies))
        finally:
            if self._adapters is not None and adapter is not None:
                await self._adapters.release(adapter)
        return [
            SampleResponse([self._sequence(c, params) for c in row], policy_version=version)
            for row in rows
        ]

    async def update_weights(self, snapshot: WeightSnapshot | None, version: int) -> None:
        if self.capabilities.weight_sync == "none":
            raise RuntimeError(
                f"the openai engine at {self.url} samples a fixed policy (sync = 'none') and "
                f"cannot take the weights of step {version}; for a vLLM server started with "
                "VLLM_SERVER_DEV_MODE=1, set [inference] sync = 'reload'"
            )
        if snapshot is None:
            raise ValueError(
                f"sync = {self.config.sync!r} needs a weight snapshot: a directory to load"
            )
        if snapshot.kind == "update":
            await self._load_adapter(snapshot)
        else:
            await self._reload(snapshot)
        self._version = version

    async def _load_adapter(self, snapshot: WeightSnapshot) -> None:
        """Serve the adapter in `snapshot.adapter` under a new name; old names are unloaded
        once no request uses them. The first load is the registration check."""
        adapter = snapshot.adapter
        if adapter is None or snapshot.tensors is not None:
            raise ValueError(
                "the openai engine takes an update that is a LoRA adapter alone: vLLM's server "
                "cannot write tensors into its weights in place; use sync = 'reload'"
            )
        if self._adapters is None:
            self._adapters = ServedAdapters(self._post, self.root, str(self.model), self.keep)
        first = not self._adapters.loaded
        try:
            await self._adapters.load(adapter, snapshot.version)
        except OpenAIServerError as exc:
            rank = _adapter_rank(adapter)
            discard(adapter)
            if not first:
                raise
            raise OpenAIServerError(
                f"{exc}; sync = 'lora' needs a vLLM server that loads LoRA adapters at run time: "
                f"{lora_server_flags(rank, self.keep)}",
                exc.status,
            ) from None
        await self._adapters.unload_idle()

    async def _reload(self, snapshot: WeightSnapshot) -> None:
        root = self.root
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(snapshot.path)}}
        try:
            await self._post(f"{root}/collective_rpc", rpc)
        except OpenAIServerError as exc:
            if exc.status == 404:
                raise OpenAIServerError(
                    f"{exc}; sync = {self.config.sync!r} needs vLLM's dev-mode endpoints: start "
                    "the server with VLLM_SERVER_DEV_MODE=1",
                    exc.status,
                ) from None
            raise
        try:  # cached prompt KV came from the old weights
            await self._post(f"{root}/reset_prefix_cache", None)
        except OpenAIServerError as exc:
            if exc.status != 404:
                raise

    async def close(self) -> None:
        if self._adapters is not None and self._http is not None:
            await self._adapters.unload_all()  # a long-lived server keeps no stale names
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()

    def _body(
        self,
        prompt: Sequence[int],
        n: int,
        params: SamplingParams,
        seed: int | None,
        model: str | None,
    ) -> Json:
        """One prompt's /completions request to `model` (the base model or an adapter's name);
        vLLM's extensions where OpenAI has no field."""
        explicit_stop = params.stop is not None
        body: Json = {
            "model": model,
            "prompt": [int(t) for t in prompt],
            "n": n,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            # Every field that shapes the distribution, at the value asked (neutral unless
            # the engine honours it), so that no server default changes it.
            **{name: getattr(params, name) for name in DISTRIBUTION_FIELDS},
            "seed": seed,
            "logprobs": self._logprobs_field,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "ignore_eos": explicit_stop,  # an explicit stop replaces EOS, as in posttrain
            "include_stop_str_in_output": True,
        }
        if params.stop_tokens():
            body["stop_token_ids"] = list(params.stop_tokens())
        if params.stop_strings():
            body["stop"] = list(params.stop_strings())
        return body

    async def _first_model(self) -> str:
        listing = await self._get(f"{self.url}/models")
        data = listing.get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict):
            raise OpenAIServerError(
                f"{self.url}/models lists no model; set [inference] model to the served name"
            )
        return str(data[0]["id"])

    async def _probe(self) -> Json:
        """A one-token completion; logprobs=1 where the server refuses 0."""
        params = SamplingParams(max_tokens=1, seed=0)
        body = self._body(PROBE_PROMPT, 1, params, seed=0, model=self.model)
        try:
            return (await self._choices(body, 1))[0]
        except OpenAIServerError as exc:
            if exc.status != 400:
                raise
            self._logprobs_field = 1
            try:
                return (await self._choices({**body, "logprobs": 1}, 1))[0]
            except OpenAIServerError:
                raise exc from None

    async def _choices(self, body: Json, n: int) -> list[Json]:
        answer = await self._post(f"{self.url}/completions", body)
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != n:
            count = len(choices) if isinstance(choices, list) else "no"
            raise OpenAIServerError(f"{self.url}/completions returned {count} choices for n={n}")
        return sorted(choices, key=lambda c: int(c.get("index", 0)))

    def _sequence(self, choice: Json, params: SamplingParams) -> SampledSequence:
        tokens = _token_ids(choice)
        if tokens is None:
            raise OpenAIServerError(f"{self.url}/completions returned a choice without token ids")
        logprobs = _logprobs(choice)
        if logprobs is None and not self.config.allow_training_without_logprobs:
            raise OpenAIServerError(f"{self.url}/completions returned a choice without logprobs")
        if logprobs is not None and len(logprobs) != len(tokens):
            raise OpenAIServerError(
                f"{self.url}/completions returned {len(logprobs)} logprobs for {len(tokens)} tokens"
            )
        reason = "length" if choice.get("finish_reason") == "length" else "stop"
        if (
            reason == "stop"
            and params.stop is not None
            and not params.stop_strings()
            and (not tokens or tokens[-1] not in params.stop_tokens())
        ):
            raise OpenAIServerError(
                f"{self.url} stopped at a token not in SamplingParams.stop: it ignores vLLM's "
                "ignore_eos / stop_token_ids, so an explicit stop cannot replace EOS there; "
                "sample with stop = None (stop at EOS)"
            )
        return SampledSequence(stop_reason=reason, tokens=tokens, logprobs=logprobs)

    async def _get(self, url: str) -> Json:
        return await self._send("GET", url, None)

    async def _post(self, url: str, body: Json | None) -> Json:
        return await self._send("POST", url, body)

    async def _send(self, method: str, url: str, body: Json | None) -> Json:
        if self._http is None:
            raise RuntimeError("the openai engine is not started (or closed): await start() first")
        import httpx

        try:
            response = await self._http.request(method, url, json=body)
        except httpx.TransportError as exc:
            raise OpenAIServerError(f"cannot reach {url}: {exc!r}") from exc
        if response.status_code >= 400:
            raise OpenAIServerError(
                f"{method} {url} answered {response.status_code}: {_server_message(response)}",
                response.status_code,
            )
        if not response.content:
            return {}
        try:
            answer = response.json()
        except ValueError:  # vLLM's adapter endpoints answer in plain text
            return {"text": response.text}
        return answer if isinstance(answer, dict) else {"result": answer}


def lora_server_flags(rank: int, keep: int) -> str:
    """What a vLLM server needs for sync = 'lora' with adapters of `rank`, `keep` loaded."""
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
    return (
        "start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora "
        f"--max-lora-rank {max_rank} --max-loras {keep} (docs/engines.md), or set [inference] "
        "sync = 'reload' (whole LoRA-merged weights, VLLM_SERVER_DEV_MODE=1)"
    )


def _adapter_rank(path: Path) -> int:
    try:
        return int(json.loads((path / "adapter_config.json").read_text())["r"])
    except (OSError, ValueError, KeyError):
        return 1  # unreadable: vLLM's smallest rank


def _check_params(params: SamplingParams) -> None:
    """What the engine cannot sample as posttrain's sampler would is refused."""
    refused = ENGINES["openai"].refused_sampling(params)
    if refused is not None:
        raise ValueError(refused)
    if params.max_tokens is None:
        raise ValueError(
            "the openai engine needs SamplingParams.max_tokens: OpenAI-compatible servers "
            "read no max_tokens as 16 tokens, not as 'until EOS'"
        )


def _token_ids(choice: Json) -> list[int] | None:
    """vLLM's `token_ids`, else the "token_id:N" tokens of `return_tokens_as_token_ids`."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        return [int(t) for t in ids]
    logprobs = choice.get("logprobs")
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if isinstance(tokens, list) and all(
        isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens
    ):
        return [int(t.removeprefix(TOKEN_ID_PREFIX)) for t in tokens]
    return None


def _logprobs(choice: Json) -> list[float] | None:
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if isinstance(values, list) and all(isinstance(v, int | float) for v in values):
        return [float(v) for v in values]
    return None


def _server_message(response: httpx.Response) -> str:
    """OpenAI's `error.message`, FastAPI's `detail`, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("error", "detail", "message"):
            if key in body:
                return str(body[key])
    return str(body)[:500]


def _require_httpx() -> None:
    if importlib.util.find_spec("httpx") is None:
        raise ImportError("the openai engine needs httpx: pip install 'posttrain[openai-engine]'")
