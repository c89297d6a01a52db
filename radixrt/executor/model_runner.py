"""Loads the model and tokenizer, sizes the pools, and runs one forward per step.

This module knows nothing of rank processes or commands: `tp_worker` starts the ranks, builds
each one's `TPGroup` and a `ModelRunner` over it, and sends rank 0's steps to the others."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PretrainedConfig

from radixrt.attention import create_backend
from radixrt.config import ExecutorArgs
from radixrt.distributed.group import TPGroup
from radixrt.executor import gguf_weights, host_memory, quant_choice
from radixrt.executor.image_features import ImageFeatures
from radixrt.executor.lora_manager import LoraManager, default_max_rank, parse_lora_paths
from radixrt.executor.model_loader import (
    check_file_sizes,
    converted_from,
    load_chat_template,
    load_model,
    read_config,
    read_generation_config,
    read_tokenizer,
    resolve_model_path,
    resolve_tokenizer_path,
)
from radixrt.executor.weight_update import adopt_weights, check_same_architecture
from radixrt.forward_batch import ForwardBatch
from radixrt.kernels import cpu_isa, fixed_gemm
from radixrt.mem_cache.kv_quant import resolve_kv_format
from radixrt.mem_cache.memory_pool import (
    PageAllocator,
    ReqToTokenPool,
    TokenToKVPool,
    bytes_per_token,
)
from radixrt.mem_cache.state_pool import StatePool
from radixrt.models.interface import CausalLM
from radixrt.models.linear import (
    BYTES_PER_WEIGHT,
    EMBEDDING,
    FixedOrderLinear,
    GroupedLinear,
    Int8Linear,
    LinearPacking,
    PrepackedLinear,
    check_quantization,
    features,
)
from radixrt.models.llava import LlavaForConditionalGeneration
from radixrt.models.pooling import Pooling
from radixrt.models.quantized import CheckpointQuant
from radixrt.models.support import check_supported

if TYPE_CHECKING:
    from radixrt.executor.cuda_graph_runner import CudaGraphRunner

logger = logging.getLogger(__name__)


def resolve_device(name: str, index: int = 0) -> torch.device:
    """`auto`, `cpu` or `cuda`; on CUDA the device `index` (a tensor-parallel rank's own GPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    return torch.device("cuda", index) if device.type == "cuda" else device


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# quantizations whose linears compute each row alone (grouped 4/8-bit: activations quantized
# per row, one order of sums whatever the rows): their attention is asked the same of prompt
# rows (`create_backend`'s rows_exact), so a cache hit or a chunk never changes an answer
ROW_INDEPENDENT_LINEARS = ("gguf", "int4")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`--dtype`: the weights' and the KV pool's; activations follow the weights, on the CPU
    too (PyTorch's half kernels there are slower than float32, but the memory is half)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


@dataclass(frozen=True)
class WeightCounts:
    """What a forward multiplies by, for compute and bandwidth floors: parameters of the matmuls
    every token goes through (the decoder layers), of the output projection (only rows whose
    logits are read), the bytes of all of them (what a step reads at least once), and the
    attention FLOPs of one (query, key) pair over all layers (q.k and p.v, every query head)."""

    layer_params: int
    head_params: int
    weight_bytes: int
    attention_flops_per_pair: int

    @classmethod
    def of(cls, model: CausalLM, config: PretrainedConfig, bytes_per_weight: float) -> WeightCounts:
        """Counts of `model`'s linears (float, prepacked or quantized: `features`), at
        `bytes_per_weight` each."""
        linears = [(n, features(m)) for n, m in model.named_modules()]
        sizes = {n: f[0] * f[1] for n, f in linears if f is not None}
        head = sizes.get("lm_head", 0)
        layers = sum(sizes.values()) - head
        per_pair = 4 * model.kv_layers * config.num_attention_heads * model.head_dim
        return cls(layers, head, int((layers + head) * bytes_per_weight), per_pair)


def linear_bytes(model: nn.Module) -> int:
    """Bytes the model's linears hold resident, as they are now (packed, prepacked or float)."""
    total = 0
    for module in model.modules():
        if isinstance(module, GroupedLinear):
            total += module.weight.nbytes
        elif isinstance(module, Int8Linear):
            total += module.weight.tiles.nbytes + module.weight.scales.nbytes
        elif isinstance(module, nn.Linear):
            total += module.weight.nbytes
        elif isinstance(module, PrepackedLinear):
            total += module.packed.nbytes
        elif isinstance(module, FixedOrderLinear):
            total += module.nbytes
    return total


def check_deterministic(
    args: ExecutorArgs,
    device: torch.device,
    dtype: torch.dtype,
    isa: cpu_isa.Isa | None,
    config: PretrainedConfig,
) -> None:
    """ValueError naming what `--enable-deterministic-inference` cannot honour here: its fixed-
    order kernels are the CPU's C kernels on float32 (or int8/int4 weights); the attention
    backends have fixed-order paths both (triton runs on the CPU under its interpreter); MoE routing and LoRA deltas have no fixed-order path yet."""
    flag = "--enable-deterministic-inference"
    if device.type != "cpu" or isa is None or not fixed_gemm.available():
        raise ValueError(f"{flag} runs on CPUs with AVX2 and a C compiler only")
    if isa is cpu_isa.Isa.TORCH:
        raise ValueError(f"{flag} needs the C kernels: --cpu-isa torch is refused with it")
    if dtype != torch.float32:
        raise ValueError(f"{flag} needs --dtype float32 (the fixed-order kernels are float32)")
    if args.lora_paths:
        raise ValueError(f"{flag} does not cover LoRA adapters yet (their deltas' kernel)")
    if args.kv_cache_dtype != "auto":
        raise ValueError(f"{flag} needs --kv-cache-dtype auto (its attention reads float32 rows)")
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        raise ValueError(f"{flag} does not cover mixture-of-experts models yet")


class ModelRunner:
    """The model (in a tensor-parallel group `tp`, this rank's shard of it; alone by default),
    its pools, and one forward and one logits call per step. Under tensor parallelism every
    rank calls both in the same order (their collectives meet); `tp_worker` sees to that."""

    def __init__(self, args: ExecutorArgs, tp: TPGroup | None = None):
        start = time.monotonic()
        self.args = args
        self.model_path = resolve_model_path(args.model)
        self.tp = tp if tp is not None else TPGroup(device=resolve_device(args.device))
        self.device = self.tp.device
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.tokenizer_path = (
            resolve_tokenizer_path(args.tokenizer_path) if args.tokenizer_path else self.model_path
        )
        for folder in {self.model_path, self.tokenizer_path}:
            check_file_sizes(folder)
        # the checkpoint's config (what the model class is built from), and its text model's,
        # which everything that serves tokens reads (the same object but for a vision-language
        # model, whose text model's config is its `text_config`)
        self.checkpoint_config = read_config(self.model_path)
        self.config = self.checkpoint_config.get_text_config()
        self.tokenizer = read_tokenizer(self.tokenizer_path)
        if args.chat_template:
            self.tokenizer.chat_template = load_chat_template(args.chat_template)
        self.context_length = check_supported(self.config, args.context_length)
        self.generation_config = read_generation_config(self.model_path)
        self.eos_token_ids = self._eos_ids(self.generation_config)
        self.pooling = Pooling.of_model(self.model_path, self.config) if args.is_embedding else None

        # the CPU kernels' path (None on CUDA); refused here, before any weight is read
        self.cpu_isa = (
            cpu_isa.resolve(args.cpu_isa, cpu_isa.host_paths())
            if self.device.type == "cpu"
            else None
        )
        self.kv_format = resolve_kv_format(args.kv_cache_dtype, self.device, args.attention_backend)
        self.checkpoint_quant = CheckpointQuant.of(self.checkpoint_config)
        self.quant = self._choose_quantization()
        check_quantization(self.quant.name, self.device, self.cpu_isa)
        if args.enable_deterministic_inference:
            check_deterministic(args, self.device, self.dtype, self.cpu_isa, self.config)
        packed = self.quant.plan
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        packing = self._packing()
        with host_memory.loading():
            self.model = load_model(
                self.model_path,
                self.checkpoint_config,
                self.context_length,
                self.tp,
                self.dtype,
                packed.meta_weights(tied) if packed else frozenset(),
                packing,
            )
            self._replace_linears(self.model, packed, packing)
        self.weights = WeightCounts.of(
            self.model,
            self.config,
            self.checkpoint_quant.bytes_per_weight
            if self.checkpoint_quant
            else BYTES_PER_WEIGHT.get(self.quant.name or "", self.dtype.itemsize),
        )
        self.packing = packing  # what weight updates pack their linears with too
        self.vocab_size = self.config.vocab_size
        self.lora = self._init_lora()
        self.image_features = (
            ImageFeatures(self.model, self.model_path)
            if isinstance(self.model, LlavaForConditionalGeneration)
            else None
        )

        self._init_pools()
        self.attn_backend = create_backend(
            args.attention_backend,
            self.device,
            self.req_to_token_pool.req_to_token,
            self.kv_pool,
            self.model.family.windows,
            self.model.family.attn_logit_softcap,
            args.enable_deterministic_inference,
            rows_exact=self.quant.name in ROW_INDEPENDENT_LINEARS,
        )
        self.graph_runner = self._graph_runner()
        logger.info(
            "loaded %s (%s, %s, linears %s [%s]: %.0f MB, CPU kernels %s, %d threads) in %.1fs; "
            "KV pool %d tokens (%s), page size %d",
            self.model_path.name,
            self.dtype,
            self.device,
            self.quantization_path,
            self.quant.reason,
            linear_bytes(self.model) / 1e6,
            self.cpu_isa.value if self.cpu_isa else "none",
            torch.get_num_threads(),
            time.monotonic() - start,
            self.allocator.total_tokens,
            args.kv_cache_dtype,
            args.page_size,
        )

    @property
    def quantization_path(self) -> str:
        """What the linears run as (`model_info` names it): the checkpoint's own quantization
        read packed, `--quantization` as resolved (`quant_choice`), or float."""
        if self.checkpoint_quant is not None:
            return self.checkpoint_quant.describe()
        return self.quant.name or "float"

    @property
    def kv_numerics(self) -> str:
        """What besides the weights and the dtype decides the bits of the KV this run computes
        (the disk tier's fingerprint names it): the linears' path, whether quantized linears
        dequantize into torch (`--cpu-isa torch`: float activations), run the C kernels (8-bit
        activations) or a GPU's Triton GEMM (float activations), and the deterministic mode's
        fixed summation order. The native `--cpu-isa` paths are one name: they give the same
        bits, so a disk tier written on an AVX2 host serves an AVX-512 one."""
        parts = [self.quantization_path]
        if self.quantization_path != "float" and self.cpu_isa is cpu_isa.Isa.TORCH:
            parts.append("dequantized in torch")
        if self.quantization_path != "float" and self.cpu_isa is None:
            parts.append("Triton GEMM")
        if self.args.enable_deterministic_inference:
            parts.append("fixed order")
        return ", ".join(parts)

    def _packing(self) -> LinearPacking | None:
        """`LinearPacking.of` the run; a pre-quantized checkpoint's linears are read packed
        into the CPU kernels' layouts (moved to a CUDA GPU for its Triton kernel), which needs
        one rank, on a CPU the kernels and float32 for the float rest, and no `--quantization`
        of its own (it would requantize them). ValueError, one line, naming what is missing."""
        args, quant = self.args, self.checkpoint_quant
        packing = LinearPacking.of(
            self.quant.name,
            self.device,
            self.dtype,
            self.cpu_isa,
            args.enable_deterministic_inference,
            self.tp.size,
        )
        if quant is None:
            return packing
        if args.enable_deterministic_inference:
            raise ValueError(
                f"--enable-deterministic-inference serves float32 or --quantization int8/int4 "
                f"weights, not a {quant.method} checkpoint (its linears are not cut in fixed order)"
            )
        if self.quant.name:
            raise ValueError(
                f"--quantization {self.quant.name}: the checkpoint is already quantized "
                f"({quant.method}); serve it without --quantization"
            )
        on_gpu = self.device.type == "cuda"
        if self.tp.size > 1 or (packing is None and not on_gpu):
            raise ValueError(
                f"{quant.method} checkpoints are served packed on one rank: on the CPU in "
                "float32, or on a CUDA GPU"
            )
        check_quantization("int4", self.device, self.cpu_isa)
        check_quantization("int8", self.device, self.cpu_isa)
        base = packing or LinearPacking(None, None, device=self.device)
        return replace(base, checkpoint=quant)

    def _choose_quantization(self) -> quant_choice.QuantChoice:
        """`--quantization` resolved for this model and machine (`quant_choice.choose`)."""
        ground = quant_choice.Ground(
            model_arg=self.args.model,
            source=converted_from(self.model_path),
            compute_device=self.device,
            isa=self.cpu_isa,
            tp_size=self.tp.size,
            deterministic=self.args.enable_deterministic_inference,
            prequantized=self.checkpoint_quant is not None,
        )
        return quant_choice.choose(self.args.quantization, ground, self.config)

    def _replace_linears(
        self,
        model: CausalLM,
        packed: gguf_weights.GGUFPlan | None,
        packing: LinearPacking | None,
    ) -> None:
        """`model`'s GGUF packed linears and embedding table (tied, the output projection's
        groups; `PackedEmbedding`), then the linears the loader did not pack as it read them (a
        tied output projection whose float weight is the embedding's, where that stays float):
        int8, int4 from float (the output projection in 8-bit groups) or float32 prepacked
        (`LinearPacking`; under `gguf`, what GGUF did not pack stays float, as before)."""
        if packed is not None:
            # on the run's device (a GPU's Triton kernel and lookups read them there), once: a
            # tied table and output projection share the groups
            cache = gguf_weights.packed_cache(self.model_path)
            read = {
                n: w.to(self.device) for n, w in gguf_weights.read_linears(packed, cache).items()
            }
            table = read.pop(EMBEDDING, None)
            for name, weight in read.items():
                parent, _, child = name.rpartition(".")
                owner = model.get_submodule(parent)
                bias = getattr(owner, child).bias
                setattr(owner, child, GroupedLinear(weight, bias, self.cpu_isa))
            if model.tied and "lm_head" in read:
                model.keep_embedding_packed(read["lm_head"], model.lm_head)
            elif table is not None:
                model.keep_embedding_packed(table, None)
        if packing is not None:
            packing.replace(model)

    # ---- weights and memory for reinforcement learning ------------------------------------------
    def update_weights(self, folder: Path, checkpoint: bool) -> None:
        """Serve the safetensors weights in `folder` from now on: a model checkpoint folder
        (`checkpoint`: its config.json must give the served architecture) or the named tensors
        an `rt.Engine` wrote. They are staged as at start (this rank's shard, every name and
        shape checked, then quantized or prepacked as the served ones: int8 and int4 are
        re-quantized, GGUF blocks are not taken) and adopted only once all of them loaded
        (`weight_update`): a ValueError names what is refused, and the old weights stay."""
        if self.quant.name == "gguf":
            raise ValueError(
                "a GGUF served packed (--quantization gguf or auto) serves the file's blocks as "
                "read: it takes no new weights (serve it with --quantization none to update them)"
            )
        if self.checkpoint_quant is not None:
            raise ValueError(
                f"a {self.checkpoint_quant.method} checkpoint is served as read: it takes no new weights"
            )
        if checkpoint:
            check_same_architecture(self.checkpoint_config, folder)
        with host_memory.loading():
            staged = load_model(
                folder,
                self.checkpoint_config,
                self.context_length,
                self.tp,
                self.dtype,
                packing=self.packing,
            )
            self._replace_linears(staged, None, self.packing)
        adopt_weights(self.model, staged)
        if isinstance(self.model, LlavaForConditionalGeneration):
            assert isinstance(staged, LlavaForConditionalGeneration) and self.image_features
            self.model.adopt_image_encoder(staged)
            self.image_features.clear()
        if self.graph_runner is not None and self.packing is not None:
            # packed linears are swapped whole: graphs captured before read the old tensors
            self.graph_runner = self._graph_runner()

    def release_kv(self) -> None:
        """Free the KV pool's memory (`release_memory_occupation`); the caller holds every
        request off it until `resume_kv`."""
        self.kv_pool.release()

    def resume_kv(self) -> None:
        """The KV pool's memory again (zeroed), and decode graphs captured over it anew."""
        self.kv_pool.restore()
        if self.graph_runner is not None:
            self.graph_runner = self._graph_runner()

    def _eos_ids(self, generation: dict[str, Any]) -> set[int]:
        """The config's, the tokenizer's and generation_config.json's end-of-sequence ids."""
        ids = set()
        for source in (
            self.config.eos_token_id,
            self.tokenizer.eos_token_id,
            generation.get("eos_token_id"),
        ):
            ids.update(
                source if isinstance(source, list) else [source] if source is not None else []
            )
        return ids

    def _init_pools(self) -> None:
        args = self.args
        kv_heads = self.model.shard.num_kv_heads
        per_token = bytes_per_token(
            self.model.kv_layers, kv_heads, self.model.head_dim, self.dtype, self.kv_format
        )
        total = args.max_total_tokens
        if total is None:
            fraction = args.mem_fraction or (0.8 if self.device.type == "cuda" else 0.1)
            total = int(available_memory(self.device) * fraction) // per_token
        total = self.tp.agree(total)  # every rank's pool has rank 0's slots: the tree is one
        if total < args.page_size * 2:
            raise ValueError(f"KV pool of {total} tokens is too small")
        self.allocator = PageAllocator(total, args.page_size, self.device)
        self.kv_pool = TokenToKVPool(
            self.allocator.num_slots,
            self.model.kv_layers,
            kv_heads,
            self.model.head_dim,
            self.dtype,
            self.device,
            self.kv_format,
        )
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests + 1, self.context_length + 1, self.device
        )
        self.state_bytes = 0
        self.state_pool = self._state_pool()

    def _state_pool(self) -> StatePool | None:
        """A recurrent model's state slots (`--max-mamba-cache-size`; by default two per
        running request, its own and as many snapshots in the tree, but no more than the KV
        pool's bytes hold); None for any other."""
        args, model = self.args, self.model
        if not model.recurrent:
            return None
        ssm_dtype = getattr(torch, args.mamba_ssm_dtype)
        per_slot = sum(t.nbytes for t in model.allocate_states(1, ssm_dtype))
        slots = args.max_mamba_cache_size
        if slots is None:
            fit = self.kv_pool.bytes_per_token * self.allocator.total_tokens // per_slot
            slots = max(2, min(2 * args.max_running_requests, fit))
        elif slots * per_slot > available_memory(self.device):
            raise ValueError(
                f"--max-mamba-cache-size {slots}: {slots} state slots of {per_slot} bytes do "
                f"not fit in the {available_memory(self.device) / 1e9:.1f} GB free"
            )
        pool = StatePool(slots, model.allocate_states(slots, ssm_dtype))
        self.state_bytes = pool.nbytes
        logger.info("%d state slots (%.1f MB)", slots, self.state_bytes / 1e6)
        return pool

    def _init_lora(self) -> LoraManager | None:
        """The adapters' pool over the model's projections, with `--lora-paths` loaded (None
        without adapters: the model's projections stay unwrapped). Wrapped after the linears
        are replaced, so a delta adds to any base: float, prepacked or int8."""
        args = self.args
        if not args.lora_enabled:
            return None
        if not self.model.projections():
            raise ValueError(
                f"LoRA adapters: {type(self.model).__name__} declares no projections to adapt"
            )
        paths = parse_lora_paths(args.lora_paths)
        rank = args.max_lora_rank or default_max_rank(paths)
        lora = LoraManager(self.model, args.max_loras_per_batch, rank, self.dtype)
        for name, path in paths.items():
            lora.load(name, path)
        return lora

    def _graph_runner(self) -> CudaGraphRunner | None:
        """Decode steps as CUDA graphs: on CUDA with the Triton backend, unless disabled or the
        model's forward reads values on the host (experts' routing)."""
        if self.device.type != "cuda" or self.args.disable_cuda_graph or self.tp.size > 1:
            return None  # graphs do not capture the ranks' commands
        if not self.model.graph_safe:
            return None
        from radixrt.attention.triton_backend import TritonAttentionBackend
        from radixrt.executor.cuda_graph_runner import CudaGraphRunner

        if not isinstance(self.attn_backend, TritonAttentionBackend):
            return None
        start = time.monotonic()
        graphs = CudaGraphRunner(
            self.model,
            self.attn_backend,
            self.req_to_token_pool.req_to_token,
            self.args.max_running_requests,
            self.context_length,
        )
        logger.info(
            "captured decode graphs for %s in %.1fs", graphs.sizes, time.monotonic() - start
        )
        return graphs

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of the batch's new tokens (a replayed graph's buffer for a decode
        batch on CUDA: read before the next forward). A batch with adapters runs eagerly: its
        segments' count and lengths are host data that change every step, which a captured
        graph cannot take (the graphs hold the base model alone). A batch with image
        placeholders gets their features here (`image_features`, encoding the images it has
        none of yet), and runs eagerly (a last chunk of one token looks like a decode)."""
        if batch.images:
            assert self.image_features is not None  # the scheduler places images only then
            batch.image_embeds = self.image_features.rows(batch.images)
        if batch.has_adapters:
            assert self.lora is not None  # the scheduler admits adapter requests only then
            self.lora.prepare(batch)
            try:
                self.attn_backend.init_forward_metadata(batch)
                return self.model(batch, self.attn_backend)
            finally:
                self.lora.finish()
        if self.graph_runner is not None and not batch.images and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch, self.attn_backend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of `hidden`'s rows over the whole vocabulary, gathered from every rank onto
        rank 0 (None on the other ranks)."""
        local = self.model.compute_logits(hidden)
        gathered = self.tp.gather_last_dim(local, self.model.vocab_widths)
        return None if gathered is None else gathered[:, : self.vocab_size]
