"""The per-parameter and per-token costs docs/scaling.md derives memory per GPU from, measured on
the shapes of Qwen2.5-0.5B, 1.5B, 7B and Llama-3.1-8B; and, with --derive, that page's tables.

Each shape is built from its published config with 1 and with 2 decoder layers and a small
vocabulary (random weights, nothing downloaded), trained as posttrain trains it (`Worker`: LoRA
rank R with posttrain's default LoraSettings on a bf16 base, or full fine-tuning in fp32) on one
PPO datum, with and without gradient checkpointing. Measured:

- bytes per parameter of the weights, the gradients after forward_backward and the AdamW state
  after optim_step, each summed over the tensors' storages (one layer of the first shape);
- activations: the peak, during forward_backward, of the bytes saved for backward that are
  alive at once (`torch.autograd.graph.saved_tensors_hooks`; each storage counted once, weights
  and buffers left out; recomputed layers' saves included), per token. The per-layer figure is
  the 2-layer peak minus the 1-layer peak; the rest (embedding output, final norm, the chunked
  logprob head) is the 1-layer peak minus one layer. Each is the slope between two datum
  lengths, so nothing that does not grow with the tokens is counted. Without checkpointing the
  per-layer figure is printed beside `Shape.layer_activations`, the formula the derivation uses.

Attention runs as on a GPU (transformers' SDPA in the model's dtype), not with posttrain's
float32 upcast for bf16 training on the CPU (`models.attention`), which only the CPU takes.
Byte counts do not depend on the machine's load. The logprob head's [chunk, vocab] logits are
transient and not saved (see docs/scaling.md for their size).

`--whole T` instead runs one forward_backward of T tokens on each whole model (every layer, or
--layers of them, the real vocabulary, gradient checkpointing), after a short one, and reports
its peak of live tensor bytes and of RSS beyond what was held before, beside what the
derivation adds up to for that pass.

`--derive` prints docs/scaling.md's tables (memory per GPU, step time, FSDP2 traffic): the
functions after "Derived" below, on the assumptions stated there and on that page. Alone it
measures nothing; `--shapes tiny` measures a tiny shape in seconds (the test suite's run).

    OMP_NUM_THREADS=2 python benchmarks/scaling_costs.py [--shapes qwen2.5-0.5b,...]
        [--modes lora,full] [--lora 32] [--tokens 64,128] [--whole 2048 [--layers 6]] [--derive]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from host import host_line
from torch import nn
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

from posttrain import Datum, ModelInput
from posttrain.algo.losses import LossConfig
from posttrain.engine.worker import Worker, WorkerConfig
from posttrain.models.load import LoraSettings, apply_lora
from posttrain.types import AdamParams

VOCAB = 1024  # the layers' costs do not depend on it; the real unembedding is counted apart

# The derivation's settings (docs/scaling.md states each).
GIB = 2**30
TOKENS = 8192  # micro_batch_tokens (posttrain's default): the tokens one pass holds
CHUNK = 1024  # logprob_chunk_size (posttrain's default)
RANK = 32  # LoRA rank (posttrain's and Tinker's default)
GPUS = (1, 2, 4, 8)
# Measured here (the output of this script and of logprobs_memory.py, see docs/scaling.md):
# bytes per token of activations outside the decoder layers, x hidden, the most over the shapes;
# and fp32 logit chunks alive at once in the logprob head.
BESIDES_X_HIDDEN = {"lora": 6.1, "full": 12.7}
HEAD_CHUNKS = 1.14
# Assumed: an H100 or H200 SXM's dense peak (bf16 tensor cores; plain fp32, as posttrain leaves
# TF32 off) and the fraction of it reached.
PEAK_FLOPS = {"lora": 989e12, "full": 67e12}
MFU = 0.35
LINKS = {"NVLink": 350e9, "50 GB/s": 50e9, "12.5 GB/s": 12.5e9}  # bytes/s an all-gather reaches
# Measured on a GPU: scripts/gpu-check's GRPO step on an H200 (docs/gpu.md, 2026-11-28) at
# Qwen2.5-0.5B's shape, no gradient checkpointing, one micro-batch a step of 4,470 computed
# tokens: 16 prompts of 31.4 tokens on average, each computed once for its 8 samples
# (min_shared_prefix), and 128 completions of 31 input tokens. Per run: LoRA rank (None: full),
# peak GiB, training-phase MFU.
GPU_RUN_TOKENS = 4470
GPU_RUN: dict[str, tuple[int | None, float, float]] = {
    "LoRA r16, bf16": (16, 11.3, 0.016),
    "full, fp32": (None, 18.8, 0.291),
}


@dataclass(frozen=True)
class Shape:
    """A published model's shape (its config.json)."""

    name: str
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool  # the input embedding is the unembedding

    def config(self, layers: int, vocab: int = VOCAB) -> PretrainedConfig:
        kind = Qwen2Config if self.arch == "qwen2" else LlamaConfig
        return kind(
            vocab_size=vocab,
            hidden_size=self.hidden,
            num_hidden_layers=layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            max_position_embeddings=4096,
            tie_word_embeddings=self.tied,
            attention_dropout=0.0,
        )

    def kv(self) -> int:
        """The key/value width: KV heads x head dim."""
        return self.kv_heads * (self.hidden // self.heads)

    def layer_params(self) -> int:
        """Weights of one decoder layer (qwen2 has q/k/v biases, llama none)."""
        h, kv = self.hidden, self.kv()
        bias = h + 2 * kv if self.arch == "qwen2" else 0
        return 2 * h * (h + kv) + bias + 3 * h * self.intermediate + 2 * h

    def params(self) -> int:
        """Every weight, with the real vocabulary."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params() + embeddings + self.hidden

    def layer_lora_params(self, rank: int) -> int:
        """One layer's adapter weights: rank x (fan_in + fan_out) of q, k, v, o, gate, up, down."""
        h, kv, i = self.hidden, self.kv(), self.intermediate
        return rank * (2 * h + 2 * (h + kv) + 2 * h + 3 * (h + i))

    def unembed_lora_params(self, rank: int) -> int:
        """The unembedding's adapter: posttrain's default adapts an unembedding of its own and
        leaves one tied to the input embedding as it is (`LoraSettings.train_unembed`)."""
        return 0 if self.tied else rank * (self.hidden + self.vocab)

    def layer_activations(self, lora: bool, rank: int = RANK) -> int:
        """Bytes per token one decoder layer saves for backward: the formulas fit to what
        `activation_costs` measures (docs/scaling.md lists the measurements)."""
        h, i, kv, heads = self.hidden, self.intermediate, self.kv(), self.heads
        if lora:  # bf16 base, fp32 adapters
            return 36 * h + 10 * i + 4 * kv + 4 * heads + 28 * rank + 8
        return 32 * h + 16 * i + 8 * kv + 4 * heads + 8  # fp32

    def flop_weights(self) -> int:
        """N of the FLOP counts: every matmul's weights, the unembedding once (an untied input
        embedding is a lookup)."""
        return self.params() - (0 if self.tied else self.vocab * self.hidden)


SHAPES = {
    s.name.lower(): s
    for s in (
        Shape("Qwen2.5-0.5B", "qwen2", 896, 24, 14, 2, 4864, 151936, tied=True),
        Shape("Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 8960, 151936, tied=True),
        Shape("Qwen2.5-7B", "qwen2", 3584, 28, 28, 4, 18944, 152064, tied=False),
        Shape("Llama-3.1-8B", "llama", 4096, 32, 32, 8, 14336, 128256, tied=False),
    )
}
# For the benchmark's own smoke run (tests/test_benchmarks.py): measured, never derived.
TINY = Shape("tiny", "llama", 64, 2, 4, 2, 128, VOCAB, tied=False)


class SavedBytes:
    """Bytes saved for backward alive at once, and their peak, while installed as the hooks."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded  # storages of weights and buffers
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, saved tensors holding it]
        self.current = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded or storage.nbytes() == 0:
            return tensor
        entry = self.live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Held(self, key, tensor)

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    @staticmethod
    def unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed  # pyright: ignore[reportReturnType]


class _Held:
    """One saved tensor; freed by autograd once its backward ran, which frees its bytes here."""

    def __init__(self, owner: SavedBytes, key: int, tensor: torch.Tensor) -> None:
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self) -> None:
        self.owner.release(self.key)


@contextlib.contextmanager
def counting(model: nn.Module) -> Iterator[SavedBytes]:
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = SavedBytes(excluded)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, SavedBytes.unpack):
        yield saved


def build(
    shape: Shape, layers: int, lora: int | None, checkpointing: bool, vocab: int = VOCAB
) -> Worker:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if lora else torch.float32
    model = AutoModelForCausalLM.from_config(
        shape.config(layers, vocab), dtype=dtype, attn_implementation="sdpa"
    )
    if lora:
        model = apply_lora(model, LoraSettings(rank=lora, alpha=float(lora)), seed=0)
    return Worker(model, WorkerConfig(gradient_checkpointing=checkpointing, min_shared_prefix=0))


def ppo_datum(tokens: int) -> Datum:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(3, 1000, (tokens + 1,), generator=gen)
    return Datum(
        ModelInput.from_ints(ids[:-1].tolist()),
        {
            "target_tokens": ids[1:],
            "logprobs": -5.0 + 0.1 * torch.randn(tokens, generator=gen),
            "advantages": torch.randn(tokens, generator=gen) / tokens,
        },
    )


def peak_saved(worker: Worker, tokens: int) -> int:
    with counting(worker.model) as saved:
        worker.forward_backward([ppo_datum(tokens)], "ppo", LossConfig())
    worker.zero_grad()
    return saved.peak


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


def state_costs(shape: Shape, lora: int | None, label: str) -> None:
    """Bytes per parameter of weights, gradients and AdamW state (one layer of `shape`)."""
    worker = build(shape, 1, lora, checkpointing=False)
    trained = list(worker.trainable_parameters().values())
    frozen = [p for p in worker.model.parameters() if not p.requires_grad]
    worker.forward_backward([ppo_datum(64)], "ppo", LossConfig())
    grads = storage_bytes([p.grad for p in trained if p.grad is not None])
    worker.optim_step(AdamParams(learning_rate=1e-5))
    moments = [
        v for s in worker.optimizer.state.values() for k, v in s.items()
        if isinstance(v, torch.Tensor) and k != "step"
    ]  # fmt: skip
    n_trained, n_frozen = sum(p.numel() for p in trained), sum(p.numel() for p in frozen)
    print(
        f"  {label} state: {n_trained:,} trained params at "
        f"{storage_bytes(trained) / n_trained:.2f} B, {n_frozen:,} frozen at "
        f"{storage_bytes(frozen) / max(n_frozen, 1):.2f} B; gradients "
        f"{grads / n_trained:.2f} B and AdamW {storage_bytes(moments) / n_trained:.2f} B "
        "per trained param",
        flush=True,
    )


def activation_costs(
    shape: Shape, lora: int | None, checkpointing: bool, tokens: tuple[int, int]
) -> tuple[float, float]:
    """(bytes per token per decoder layer, bytes per token for the rest)."""
    slopes = []
    for layers in (1, 2):
        worker = build(shape, layers, lora, checkpointing)
        low, high = (peak_saved(worker, t) for t in tokens)
        slopes.append((high - low) / (tokens[1] - tokens[0]))
        del worker
    per_layer = slopes[1] - slopes[0]
    return per_layer, slopes[0] - per_layer


def whole_model_check(shape: Shape, lora: int | None, tokens: int) -> None:
    """One forward_backward of `tokens` tokens on `shape` (its layers, the real vocabulary,
    gradient checkpointing), after a short one, measured twice: the peak of RSS, which also
    counts what the C allocator keeps after a free, and the peak of live tensor bytes
    (torch.profiler's memory timeline: every tensor's allocation and free), each beyond what
    was held before; beside what the derivation adds up to for that pass."""
    worker = build(shape, shape.layers, lora, checkpointing=True, vocab=shape.vocab)
    datum = ppo_datum(tokens)
    # A short pass first: what the first pass allocates once (and keeps) is not the step's.
    worker.forward_backward([ppo_datum(16)], "ppo", LossConfig())
    worker.zero_grad()
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    worker.forward_backward([datum], "ppo", LossConfig())
    rss = _status_bytes("VmHWM") - before
    grads = storage_bytes([p.grad for p in worker.model.parameters() if p.grad is not None])
    worker.zero_grad()
    activities = [ProfilerActivity.CPU]
    with profile(
        activities=activities, profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        worker.forward_backward([datum], "ppo", LossConfig())
    with tempfile.TemporaryDirectory() as directory:
        timeline = Path(directory) / "timeline.json"
        prof.export_memory_timeline(str(timeline), device="cpu")
        _, sizes = json.loads(timeline.read_text())
    totals = [sum(by_category) for by_category in sizes]  # the first: the weights, held before
    derived = grads + pass_bytes(shape, lora is not None, True, tokens)
    live = (max(totals) - totals[0]) / GIB
    print(
        f"  {shape.layers} layers, {tokens} tokens, checkpointing: peak beyond what was held "
        f"before: live tensors {live:.2f} GiB, RSS {rss / GIB:.2f} GiB; derived "
        f"{derived / GIB:.2f} GiB (gradients {grads / GIB:.2f} GiB, activations and logprob head)",
        flush=True,
    )


# Derived: arithmetic on the costs above, for the published shapes (docs/scaling.md).


def pass_bytes(
    shape: Shape, lora: bool, checkpointing: bool, tokens: int = TOKENS, rank: int = RANK
) -> float:
    """Activations saved for backward by one micro-batch of `tokens` tokens, and the logprob
    head's transient fp32 logits."""
    mode = "lora" if lora else "full"
    layer = shape.layer_activations(lora, rank)
    if checkpointing:  # every layer's input (bf16 or fp32), and the one layer being recomputed
        per_token = shape.layers * (2 if lora else 4) * shape.hidden + layer
    else:
        per_token = shape.layers * layer
    per_token += BESIDES_X_HIDDEN[mode] * shape.hidden
    return tokens * per_token + HEAD_CHUNKS * CHUNK * shape.vocab * 4


def memory_per_gpu(
    shape: Shape,
    gpus: int,
    lora: bool,
    checkpointing: bool,
    tokens: int = TOKENS,
    rank: int = RANK,
) -> float:
    """GiB one GPU holds at the peak of forward_backward: FSDP2 over `gpus` workers, or a whole
    replica for 1. Weights at 2 B (LoRA's bf16 base) or 4 B (fp32); each trained weight 16 B
    (fp32 weight, gradient, two AdamW moments)."""
    whole = shape.vocab * shape.hidden  # the unembedding, or the embedding tied to it: replicated
    sharded = shape.params() - whole
    layer = shape.layer_params()
    if lora:
        adapters = shape.layers * shape.layer_lora_params(rank)  # sharded with their layers
        state = 2 * (sharded / gpus + whole)
        state += 16 * (adapters / gpus + shape.unembed_lora_params(rank))
        gathered_layer = 2 * layer + 4 * shape.layer_lora_params(rank)
        layer_grads = 4 * shape.layer_lora_params(rank)
    else:
        state = 16 * (sharded / gpus + whole)
        gathered_layer = layer_grads = 4 * layer
    gathered = 0.0
    if gpus > 1:  # FSDP2's unsharded working set
        # The root unit's own weights (an untied input embedding) stay gathered from forward to
        # backward; two layers are gathered at once (one computing, the next prefetched) and
        # one layer's gradients are whole until their reduce-scatter.
        root = 0 if shape.tied else (2 if lora else 4) * shape.vocab * shape.hidden
        gathered = root + 2 * gathered_layer + layer_grads
    return (state + gathered + pass_bytes(shape, lora, checkpointing, tokens, rank)) / GIB


def seconds_per_million_tokens(shape: Shape, gpus: int, lora: bool) -> float:
    """Training compute with gradient checkpointing, data-parallel over `gpus`: 8 N per token
    for full fine-tuning (forward, backward for inputs and weights, the recomputed forward) and
    6 N for LoRA (the base needs no weight gradients), at MFU of the peak."""
    mode = "lora" if lora else "full"
    flops = (6 if lora else 8) * shape.flop_weights() * 1e6
    return flops / (gpus * PEAK_FLOPS[mode] * MFU)


def fsdp_traffic_bytes(shape: Shape, gpus: int, lora: bool) -> float:
    """Bytes one GPU receives or sends per micro-batch under FSDP2: the sharded weights gathered
    in forward and again in backward, and (full fine-tuning) the gradients reduce-scattered,
    (gpus - 1) / gpus of each."""
    sharded = shape.params() - shape.vocab * shape.hidden
    moved = 2 * (2 if lora else 4) * sharded + (0 if lora else 4 * sharded)
    return moved * (gpus - 1) / gpus


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def derived_tables() -> dict[str, str]:
    """docs/scaling.md's derived tables, as markdown, by title."""
    trainings = (("LoRA 32", True), ("full", False))
    tables = {}
    for checkpointing in (True, False):
        rows = [
            [shape.name, label]
            + [f"{memory_per_gpu(shape, n, lora, checkpointing):.1f}" for n in GPUS]
            for shape in SHAPES.values()
            for label, lora in trainings
        ]
        header = ["model", "training", "1 GPU or replicas", *(f"FSDP2 ×{n}" for n in GPUS[1:])]
        tables[f"GiB per GPU, gradient_checkpointing={checkpointing}"] = markdown(header, rows)
    rows = [
        [shape.name if lora else "", f"{shape.flop_weights() / 1e9:.2f} B" if lora else "", label]
        + [f"{seconds_per_million_tokens(shape, n, lora):.0f}" for n in GPUS]
        for shape in SHAPES.values()
        for label, lora in trainings
    ]
    header = ["model", "N (FLOP weights)", "training", "1 GPU", *map(str, GPUS[1:])]
    tables["seconds of training compute per million tokens"] = markdown(header, rows)
    big, gpus = SHAPES["llama-3.1-8b"], GPUS[-1]
    rows = []
    for label, lora in trainings:
        mode = "lora" if lora else "full"
        compute = TOKENS * (6 if lora else 8) * big.flop_weights() / (PEAK_FLOPS[mode] * MFU)
        moved = fsdp_traffic_bytes(big, gpus, lora)
        rows.append(
            [f"{big.name}, {label}", f"{compute:.2g} s"]
            + [f"{moved / rate:.2g} s" for rate in LINKS.values()]
        )
    header = [f"{gpus} GPUs, {TOKENS}-token micro-batch", "compute", *LINKS]
    tables["FSDP2 traffic per micro-batch"] = markdown(header, rows)
    small = SHAPES["qwen2.5-0.5b"]
    rows = []
    for run, (rank, peak, mfu) in GPU_RUN.items():
        derived = memory_per_gpu(small, 1, rank is not None, False, GPU_RUN_TOKENS, rank or RANK)
        rows.append([run, f"{peak:.1f}", f"{derived:.1f}", f"{mfu:.1%}"])
    header = [
        "gpu-check on an H200, Qwen2.5-0.5B",
        "measured peak GiB",
        "derived GiB",
        "training MFU",
    ]
    tables["the GPU run beside the derivation"] = markdown(header, rows)
    return tables


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--shapes",
        help=f"of {', '.join([*SHAPES, 'tiny'])} (default: all but tiny, or none with --derive)",
    )
    parser.add_argument("--lora", type=int, default=RANK)
    parser.add_argument("--tokens", default="64,128", help="the two datum lengths")
    parser.add_argument("--whole", type=int, default=0, help="tokens of a whole-model check")
    parser.add_argument("--layers", type=int, default=0, help="of the whole-model check (all)")
    parser.add_argument("--modes", default="lora,full", help="lora (bf16 base), full (fp32)")
    parser.add_argument("--derive", action="store_true", help="print docs/scaling.md's tables")
    args = parser.parse_args()
    print(host_line(), flush=True)
    if args.derive:
        for title, table in derived_tables().items():
            print(f"{title}:\n\n{table}\n", flush=True)
    names = args.shapes.split(",") if args.shapes else [] if args.derive else list(SHAPES)
    low, high = (int(t) for t in args.tokens.split(","))
    modes: list[tuple[str, int | None]] = [
        (label, lora)
        for key, label, lora in (
            ("lora", f"LoRA {args.lora}, bf16 base", args.lora),
            ("full", "full, fp32", None),
        )
        if key in args.modes.split(",")
    ]
    if names:
        load = os.getloadavg()[0]
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, 1-min load "
            f"{load:.1f} (byte counts do not depend on it)",
            flush=True,
        )
    for index, name in enumerate(names):
        shape = {**SHAPES, "tiny": TINY}[name]
        print(
            f"{name}: {shape.params() / 1e9:.3f}B params, {shape.layer_params():,} per layer, "
            f"hidden {shape.hidden}, {shape.layers} layers, vocab {shape.vocab}",
            flush=True,
        )
        for label, lora in modes:
            if args.whole:
                print(f"  {label}:", flush=True)
                whole_model_check(
                    replace(shape, layers=args.layers or shape.layers), lora, args.whole
                )
                continue
            if index == 0:  # the same bytes per parameter for every shape
                state_costs(shape, lora, label)
            for checkpointing in (False, True):
                per_layer, rest = activation_costs(shape, lora, checkpointing, (low, high))
                formula = shape.layer_activations(lora is not None, lora or 0)
                beside = "" if checkpointing else f", formula {formula}"
                print(
                    f"  {label}, checkpointing {checkpointing!s:5}: {per_layer:9.0f} B/token "
                    f"per layer ({per_layer / shape.hidden:5.1f} x hidden{beside}), "
                    f"{rest:7.0f} B/token ({rest / shape.hidden:4.1f} x hidden) besides",
                    flush=True,
                )


if __name__ == "__main__":
    main()
