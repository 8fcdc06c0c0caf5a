"""The Tinker protocol's sampling endpoints: sampling sessions (base model, a sampler or
training checkpoint, or an ephemeral snapshot) and `asample`, which also serves
`compute_logprobs` (prompt logprobs).

Concurrent sample requests of all samplers are batched together, each row with its own
adapter (`server.sample_batching`); a request for prompt logprobs runs alone. A request whose
sampler finds no room (`--max-resident-adapters`) waits for some, as a training request does.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from fastapi import HTTPException, Request

from posttrain.server import tinker_schema as s
from posttrain.server.sample_batching import PendingSample, SampleGatherer
from posttrain.server.store import SamplerRow
from posttrain.server.tinker_api import Api, in_client_terms, not_found, owner
from posttrain.types import ModelInput


class SamplingApi:
    def __init__(self, api: Api) -> None:
        self.api = api
        self.rt = api.rt
        self.store = api.store
        self.gatherer = SampleGatherer(
            self.rt.run, self.rt.sampler_for_row, self._on_compute, self.rt.residency.room
        )

    def _on_compute(self, fn: Callable[[], None], tenant: str) -> asyncio.Future[None]:
        return asyncio.wrap_future(self.rt.sampling.submit(fn, tenant=tenant))

    async def batching_stats(self) -> dict[str, object]:
        """How many sampling jobs ran and how many requests and samplers they batched."""
        return {**self.gatherer.stats.as_json(), "max_rows": self.gatherer.max_rows}

    async def create_sampling_session(
        self, body: s.CreateSamplingSession, request: Request
    ) -> dict[str, object]:
        who = owner(request)
        self.api.session(body.session_id, who)
        row = self.sampler_row(body.model_path, body.base_model, who, body.session_id)
        self.store.add_sampler(row)
        return {"sampling_session_id": row.sampling_session_id, "type": "create_sampling_session"}

    def sampler_row(
        self, model_path: str | None, base_model: str | None, who: str, session_id: str | None
    ) -> SamplerRow:
        sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"
        if model_path:
            ckpt = self.api.checkpoint(model_path, who)
            model = self.store.model(ckpt.model_id, who)
            if model is None:
                raise not_found(f"checkpoint {model_path!r}")
            return SamplerRow(
                sampler_id, who, session_id, model.base_model, model_path, ckpt.dir, model.lora
            )
        if not base_model:
            raise HTTPException(400, "give model_path (a tinker:// checkpoint) or base_model")
        self.api.check_base_model(base_model)
        return SamplerRow(sampler_id, who, session_id, base_model, None, None, None)

    async def get_sampler(self, sampler_id: str, request: Request) -> dict[str, object]:
        row = self.store.sampler(sampler_id, owner(request))
        if row is None:
            raise not_found(f"sampler {sampler_id!r}")
        return {
            "sampler_id": sampler_id,
            "base_model": row.base_model,
            "model_path": row.model_path,
        }

    def check_weights(self, row: SamplerRow) -> None:
        """Refuse a sampler whose weights are gone: 410 for a snapshot whose session finished
        (what the SDK gets for any request of a finished session), 404 for a deleted checkpoint.
        Checked before anything is queued, so a request never reloads deleted weights."""
        snapshot = row.model_path is None and row.weights_dir is not None
        if snapshot and self.store.session_state(row.session_id or "", row.owner) != "live":
            raise HTTPException(
                410,
                f"sampler {row.sampling_session_id!r} was a snapshot of session "
                f"{row.session_id!r}, which has finished: its weights are deleted; save named "
                "sampler weights to sample them after the session",
            )
        if row.model_path is not None and self.store.checkpoint(row.model_path, row.owner) is None:
            raise HTTPException(
                404,
                f"checkpoint {row.model_path!r} of sampler {row.sampling_session_id!r} was "
                "deleted; create a sampling client from a checkpoint that exists",
            )

    async def asample(self, body: s.Sample, request: Request) -> dict[str, object]:
        who = owner(request)
        if body.sampling_session_id:
            row = self.store.sampler(body.sampling_session_id, who)
            if row is None:
                raise not_found(f"sampling session {body.sampling_session_id!r}")
            self.check_weights(row)
        else:
            row = self.sampler_row(body.model_path, body.base_model, who, None)
        unsupported = {
            "topk_prompt_logprobs": body.topk_prompt_logprobs > 0,
            "topk_sample_logprobs": body.topk_sample_logprobs > 0,
            "prompt_alt_tokens_k": body.prompt_alt_tokens_k > 0,
            "prompt_logprobs_last_n": body.prompt_logprobs_last_n is not None,
            "target_prompt_logprobs": body.target_prompt_logprobs is not None,
        }
        if any(unsupported.values()):
            names = [k for k, v in unsupported.items() if v]
            raise HTTPException(400, f"not supported by posttrain serve: {', '.join(names)}")
        # Built here, not in the job: what they refuse is the caller's to fix (a 400 naming it).
        try:
            prompt = ModelInput.from_ints([t for c in body.prompt.chunks for t in c.tokens])
            params = body.sampling_params.params()
        except ValueError as err:
            raise HTTPException(400, str(err)) from None
        key = None if body.seq_id is None else f"{row.sampling_session_id}#sample{body.seq_id}"
        rid, new = await self.api.new_future(request, "sample", key, row.sampling_session_id)
        if new:
            names = self._names(row)
            self.gatherer.add(
                PendingSample(
                    rid,
                    row.session_id or who,
                    row,
                    prompt,
                    body.num_samples,
                    params,
                    lambda job: in_client_terms(job, names),
                    prompt_logprobs=body.prompt_logprobs,
                )
            )
        ids = [f"{rid}:{i}" for i in range(body.num_samples)]
        return {"request_id": rid, "sample_sequence_ids": ids}

    def _names(self, row: SamplerRow) -> dict[str, str]:
        """What the client calls the server's paths, for its error messages."""
        names = self.api.path_names()
        if row.weights_dir is not None:
            names[row.weights_dir] = row.model_path or f"sampler {row.sampling_session_id}"
        return names
