"""One model replica: logprobs, losses with accumulated gradients, optimizer steps, state I/O.

A worker knows micro-batches, never mini-batches: it splits whatever it is given by a token
budget, longest datums first so that similar lengths share a micro-batch, rows that start with
the same tokens together so those run once (`shared_prefix`), and accumulates gradients with sum
semantics, so the split never changes the result. With `packing` it lays datums end to end in
rows instead, each attending only to itself (`packing`), for the same results.

A forward_backward is all or nothing. All of its input is checked before the first backward
(`datum_checks`, one micro-batch at a time), so bad input changes nothing; and for a fault
during the pass (out of memory, say) it accumulates into fresh gradient tensors while the
earlier calls' gradients are set aside: on success they are added in, on failure the partial
sums are dropped and the earlier ones put back untouched. Setting aside moves no data: it costs
one add per gradient element when calls accumulate (nothing on a step's first call), and holds
the earlier gradients beside the new ones while the call runs, as a snapshot would; a
snapshot/restore would also copy every gradient on every call.

Where the state lives (device or parked on the CPU) is its `Parking`'s business
(`engine.placement`); the worker refuses to run on parked state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from posttrain.algo.loss_metrics import counted_values
from posttrain.algo.losses import LossBatch, LossConfig, get_loss
from posttrain.engine import checkpoint, datum_checks, placement
from posttrain.engine.batching import pad_datums
from posttrain.engine.checkpoint import JSONValue
from posttrain.engine.decode.sampler import Sampler
from posttrain.engine.logprob_pass import (
    adapters_disabled,
    packed_target_logprobs,
    target_logprobs,
)
from posttrain.engine.optim import create_adamw_optimizer, set_adam_params
from posttrain.engine.packing import PackedRows, pack_datums, packing_problem, plan_packed
from posttrain.engine.placement import Parking, StateGroup
from posttrain.engine.recompute import enable_gradient_checkpointing
from posttrain.engine.shared_prefix import (
    MicroBatch,
    PrefixGroup,
    plan_micro_batches,
    sharing_problem,
)
from posttrain.models.load import causal_lm
from posttrain.tokenizer import Tokenizer
from posttrain.types import AdamParams, Datum, SampleResponse, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    micro_batch_tokens: int = 8192  # padded tokens per micro-batch (rows x longest row)
    logprob_chunk_size: int = 1024
    device: str = "cpu"
    # Rows sharing at least this many leading tokens (a prompt's completions) run them once
    # (engine.shared_prefix); 0 turns sharing off.
    min_shared_prefix: int = 8
    # Recompute each decoder layer in backward (`engine.recompute`): activations of one layer
    # instead of all, for about one more forward pass.
    gradient_checkpointing: bool = False
    # Pack datums end to end into rows, each attending only to itself (`engine.packing`),
    # instead of padding each to its micro-batch's longest. Rows that share a prefix then run
    # it once per row: packing turns prefix sharing off.
    packing: bool = False

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.min_shared_prefix < 0:
            raise ValueError(
                f"min_shared_prefix must be >= 0 (0 turns sharing off), got {self.min_shared_prefix}"
            )
        if self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")


@dataclass
class PassResult:
    """What one forward / forward_backward returns from one worker.

    `diagnostics` holds 1-D per-token values over the loss's tokens, so results from several
    workers concatenate into the whole-batch values exactly. `entropies` holds each datum's
    per-token entropy beside its logprobs (None for a critic): a client that sent no mask (the
    Tinker protocol has none) takes its statistics over the tokens that count itself.
    """

    logprobs: list[torch.Tensor]
    loss_sum: float
    num_tokens: int
    diagnostics: dict[str, torch.Tensor] = field(default_factory=dict[str, torch.Tensor])
    entropies: list[torch.Tensor] | None = None


class Worker:
    """Holds a model (full or PEFT LoRA), its optimizer, and runs the primitive operations."""

    def __init__(
        self,
        model: nn.Module,
        config: WorkerConfig | None = None,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        reference_factory: Callable[[], nn.Module] | None = None,
    ) -> None:
        self.config = config or WorkerConfig()
        self.model = model.to(self.config.device)
        self.model.train()
        if self.config.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.tokenizer = tokenizer
        self._sampler: Sampler | None = None
        self.optimizer = create_adamw_optimizer(self.trainable_parameters().values())
        self._reference_factory = reference_factory
        self._reference: nn.Module | None = None
        lm_config = getattr(causal_lm(model), "config")  # noqa: B009 - HF config, hidden from nn.Module's stubs
        self.vocab_size = int(lm_config.vocab_size)
        self.max_positions = int(getattr(lm_config, "max_position_embeddings", 1 << 30))
        self.parking = Parking(self)
        if self.config.packing:
            self._check_packing()
        elif self.config.min_shared_prefix > 0:
            self._note_no_sharing(lm_config)
        # Gradients of earlier calls, set aside while an uncommitted forward_backward runs.
        self._earlier_grads: dict[str, torch.Tensor | None] | None = None

    @staticmethod
    def _note_no_sharing(lm_config: object) -> None:
        """One line where shared prefixes cannot run on this model (rows then run whole)."""
        why = sharing_problem(lm_config) if isinstance(lm_config, PretrainedConfig) else None
        if why is not None:
            model_type = getattr(lm_config, "model_type", "this model")
            log.info("shared prefixes are off for %s: %s", model_type, why)

    @property
    def device(self) -> torch.device:
        return torch.device(self.config.device)

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def weight_modules(self) -> list[nn.Module]:
        """The model, and the frozen reference copy once built: what holds weights."""
        return [m for m in (self.model, self._reference) if m is not None]

    def check_datums(self, datums: Sequence[Datum], loss_fn: str, loss_config: LossConfig) -> None:
        """Reject bad input before any compute, so a failed call leaves the worker unchanged.

        The loss's value checks run one micro-batch at a time over the pass's own plan, so
        they hold no more than the pass does. Pass `checked=True` to the call that follows, so
        the datums are checked once.
        """
        self._check(datums, loss_fn, loss_config, self._micro_batches(datums))

    def _check(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_config: LossConfig,
        plan: Sequence[MicroBatch],
    ) -> None:
        datum_checks.check_datums(
            datums,
            loss_fn,
            loss_config,
            vocab_size=self.vocab_size,
            max_positions=self.max_positions,
            micro_batches=[micro.rows for micro in plan],
        )

    def forward(self, datums: Sequence[Datum], loss_fn: str, loss_config: LossConfig) -> PassResult:
        """Logprobs and loss without gradients; changes no state.

        A loss value the loss rejects fails the pass itself with the same error, and a failed
        forward leaves nothing behind, so only the checks that need no compute run first (token
        ids, lengths, keys, config), once, here: no caller checks a forward ahead.
        """
        self._require("weights")
        datum_checks.check_call(
            datums,
            loss_fn,
            loss_config,
            vocab_size=self.vocab_size,
            max_positions=self.max_positions,
        )
        with torch.no_grad():
            return loss_pass(
                self.model,
                self.config,
                datums,
                loss_fn,
                loss_config,
                self._micro_batches(datums),
                backward=False,
            )

    def forward_backward(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_config: LossConfig,
        *,
        commit: bool = True,
        checked: bool = False,
    ) -> PassResult:
        """Add the gradient of the summed loss to the accumulated gradients, or fail leaving
        them exactly as they were.

        `commit=False` keeps this call's gradients apart until `commit_gradients` or
        `discard_gradients`: Dispatch uses it so a call that fails on one rank is undone on all.
        `checked=True` says the caller already ran `check_datums` on exactly these datums, loss
        and config (every executor does, on every rank before any computes), so they are not
        checked again.
        """
        self._require("weights", "grads")
        plan = self._micro_batches(datums)
        if not checked:
            self._check(datums, loss_fn, loss_config, plan)
        params = self.trainable_parameters()
        self._earlier_grads = placement.detach_grads(params)
        try:
            result = loss_pass(
                self.model, self.config, datums, loss_fn, loss_config, plan, backward=True
            )
        except BaseException:
            self.discard_gradients()
            raise
        if commit:
            self.commit_gradients()
        return result

    def commit_gradients(self) -> None:
        """Add the set-aside gradients of earlier calls to the last call's (a no-op if none)."""
        if self._earlier_grads is not None:
            placement.add_grads(self.trainable_parameters(), self._earlier_grads)
            self._earlier_grads = None

    def discard_gradients(self) -> None:
        """Drop the last uncommitted call's gradients and put the earlier ones back."""
        if self._earlier_grads is not None:
            placement.attach_grads(self.trainable_parameters(), self._earlier_grads)
            self._earlier_grads = None

    def reference_logprobs(self, datums: Sequence[Datum]) -> list[torch.Tensor]:
        """Target logprobs under the reference policy: the base model (LoRA off) or a frozen copy."""
        self._require("weights")
        datum_checks.check_same_keys(datums)
        datum_checks.check_model_limits(datums, self.vocab_size, self.max_positions)
        model = self.model
        if self._reference_factory is not None and not hasattr(self.model, "disable_adapter"):
            if self._reference is None:
                self._reference = self._reference_factory().to(self.config.device).eval()
            model = self._reference
        out: list[torch.Tensor] = [torch.empty(0)] * len(datums)
        with torch.no_grad(), adapters_disabled(model):
            for micro in self._micro_batches(datums, packing=False):
                batch = pad_datums([datums[r] for r in micro.rows], device=self.config.device)
                logp_BT, _ = target_logprobs(
                    model,
                    batch.input_ids_BT,
                    batch.pad_mask_BT,
                    batch.inputs["target_tokens"],
                    chunk_size=self.config.logprob_chunk_size,
                    prefix_groups=micro.groups,
                )
                for i, row in enumerate(micro.rows):
                    out[row] = logp_BT[i, : batch.lengths[i]].float().cpu()
        return out

    def _micro_batches(
        self, datums: Sequence[Datum], *, packing: bool | None = None
    ) -> list[MicroBatch]:
        """Longest first within the token budget, keeping rows that share a prefix together;
        or packed rows within it (`packing`, the config's unless given)."""
        if self.config.packing if packing is None else packing:
            return [
                packed_micro_batch(rows)
                for rows in plan_packed([d.length for d in datums], self.config.micro_batch_tokens)
            ]
        return plan_micro_batches(
            [d.model_input.to_ints() for d in datums],
            self.config.micro_batch_tokens,
            self.config.min_shared_prefix,
        )

    def set_logprob_chunk_size(self, chunk_size: int) -> None:
        self.config = replace(self.config, logprob_chunk_size=chunk_size)

    def set_packing(self, packing: bool) -> None:
        if packing:
            self._check_packing()
        self.config = replace(self.config, packing=packing)

    def _check_packing(self) -> None:
        problem = packing_problem(getattr(causal_lm(self.model), "config", None))  # HF config
        if problem is not None:
            raise ValueError(problem)

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def sampler(self) -> Sampler:
        if self.tokenizer is None:
            raise ValueError("this worker has no tokenizer; give one to sample")
        if self._sampler is None:
            self._sampler = Sampler(self.model, self.tokenizer)
        return self._sampler

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        num_samples: int,
        params: SamplingParams,
        first_index: int = 0,
    ) -> list[SampleResponse]:
        self._require("weights")
        return self.sampler().sample(prompts, num_samples, params, first_index=first_index)

    def compute_logprobs(self, prompt: Sequence[int]) -> list[float | None]:
        self._require("weights")
        return self.sampler().compute_logprobs(prompt)

    def grads(self) -> dict[str, torch.Tensor | None]:
        self._require("grads")
        return {n: p.grad for n, p in self.trainable_parameters().items()}

    def set_grads(self, grads: Mapping[str, torch.Tensor | None]) -> None:
        self._require("grads")
        for name, param in self.trainable_parameters().items():
            grad = grads[name]
            param.grad = None if grad is None else grad.to(param.device).clone()

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Clip, step AdamW with this call's settings, zero gradients. Skips non-finite grads.

        `grad_norm:mean` is the total L2 norm before clipping (NaN when skipped).
        """
        self._require(*placement.GROUPS)
        params = list(self.trainable_parameters().values())
        if all(p.grad is None for p in params):
            return {
                "grad_norm:mean": 0.0,
                "skipped:sum": 1.0,
                "learning_rate:mean": adam.learning_rate,
            }
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        skipped = not math.isfinite(norm)
        if not skipped:
            set_adam_params(
                self.optimizer,
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
            self.optimizer.step()
        self.zero_grad()
        return {
            "grad_norm:mean": norm if not skipped else float("nan"),
            "skipped:sum": float(skipped),
            "learning_rate:mean": adam.learning_rate,
        }

    def zero_grad(self) -> None:
        self._require_committed()
        self.optimizer.zero_grad(set_to_none=True)
        self.parking.drop_grads()

    def save_state(
        self,
        path: Path,
        with_optimizer: bool = True,
        trainer_state: Mapping[str, JSONValue] | None = None,
    ) -> Path:
        return checkpoint.save_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer if with_optimizer else None,
            trainer_state=dict(trainer_state or {}),
        )

    def save_weights(self, path: Path) -> Path:
        return checkpoint.save_weights(path, self.model)

    def load_state(self, path: Path, with_optimizer: bool = True) -> dict[str, JSONValue]:
        """Weights only, or (with_optimizer) an exact resume: optimizer and RNG state too.

        The accumulated gradients belong to the old weights, so a load drops them; a refused
        load (checked whole before anything changes) keeps them, as it keeps the weights.
        """
        self._require("weights", "optimizer")
        trainer_state = checkpoint.load_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer if with_optimizer else None,
            restore_rng=with_optimizer,
        )
        self.zero_grad()
        return trainer_state

    def move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        """Park `offload` on the CPU, then bring `reload` back (`Parking.move`): Dispatch's
        moves of one `prepare`."""
        self._require_committed()
        self.parking.move(offload, reload)

    def _require(self, *groups: StateGroup) -> None:
        self._require_committed()
        self.parking.require(*groups)

    def _require_committed(self) -> None:
        if self._earlier_grads is not None:
            raise RuntimeError(
                "the last forward_backward(commit=False) was neither committed nor discarded"
            )


def loss_pass(
    model: nn.Module,
    config: WorkerConfig,
    datums: Sequence[Datum],
    loss_fn: str,
    loss_config: LossConfig,
    plan: Sequence[MicroBatch],
    *,
    backward: bool,
) -> PassResult:
    """Logprobs and loss of `datums`, one micro-batch of `plan` at a time; with `backward`,
    each micro-batch's loss gradient is added to the parameters' `.grad`."""
    fn = get_loss(loss_fn)
    logprobs: list[torch.Tensor] = [torch.empty(0)] * len(datums)
    entropies: list[torch.Tensor] | None = [torch.empty(0)] * len(datums)
    diagnostics: dict[str, list[torch.Tensor]] = {}
    loss_sum, num_tokens = 0.0, 0
    for micro in plan:
        rows = micro.rows
        batch = pad_datums([datums[r] for r in rows], device=config.device)
        if micro.packed is not None:
            packed = pack_datums([datums[r] for r in rows], micro.packed, device=config.device)
            logp_RW, entropy_RW = packed_target_logprobs(
                model,
                packed.input_ids_RW,
                packed.position_ids_RW,
                packed.targets_RW,
                chunk_size=config.logprob_chunk_size,
                with_entropy=True,
            )
            logp_BT = packed.unpack(logp_RW)
            entropy_BT = None if entropy_RW is None else packed.unpack(entropy_RW)
        else:
            logp_BT, entropy_BT = target_logprobs(
                model,
                batch.input_ids_BT,
                batch.pad_mask_BT,
                batch.inputs["target_tokens"],
                chunk_size=config.logprob_chunk_size,
                with_entropy=True,
                prefix_groups=micro.groups,
            )
        out = fn(LossBatch(logp_BT, batch.inputs, batch.pad_mask_BT, entropy_BT), loss_config)
        if backward:
            out.loss.backward()
        loss_sum += float(out.loss.detach())
        num_tokens += int((out.mask_BT != 0).sum()) if out.mask_BT is not None else batch.num_tokens
        for key, flat in counted_values(out).items():
            diagnostics.setdefault(key, []).append(flat)
        for i, (row, length) in enumerate(zip(rows, batch.lengths, strict=True)):
            logprobs[row] = logp_BT[i, :length].detach().float().cpu()
            if entropy_BT is None:
                entropies = None
            elif entropies is not None:
                entropies[row] = entropy_BT[i, :length].detach().float().cpu()
    merged = {k: torch.cat(v) for k, v in diagnostics.items()}
    return PassResult(logprobs, loss_sum, num_tokens, merged, entropies)


def packed_micro_batch(rows: Sequence[Sequence[int]]) -> MicroBatch:
    """A micro-batch of packed rows of datum indices (`engine.packing.plan_packed`)."""
    flat = [i for row in rows for i in row]
    position = {datum: p for p, datum in enumerate(flat)}
    groups = [PrefixGroup((p,), 0) for p in range(len(flat))]
    packed = PackedRows(tuple(tuple(position[i] for i in row) for row in rows))
    return MicroBatch(flat, groups, packed)
