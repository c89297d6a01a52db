"""New weights for the model being served, in place (`update_weights_from_disk` and
`update_weights_from_tensor`): what is checked, and how staged weights replace the live ones.

An update is staged first: `ModelRunner.update_weights` loads the new checkpoint into a second
model with `model_loader.load_model` (the load path of a start: this rank's shard, every name and
shape checked, refused by name) and quantizes it as at start. Only once the whole of it loaded
does `adopt_weights` move it into the live model, so a refused or unreadable checkpoint leaves
the old weights intact. Staging holds a second copy of the weights for the time of an update.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixrt.models.layers import PackedEmbedding
from radixrt.models.linear import FixedOrderLinear, GroupedLinear, Int8Linear, PrepackedLinear
from radixrt.models.lora import LoraSite

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# the config fields that fix the architecture and every weight's shape: an update must keep them
ARCHITECTURE_FIELDS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "num_local_experts",
    "num_experts",
    "moe_intermediate_size",
)
# the dtypes a trainer may broadcast a weight in (`update_weights_from_distributed`)
DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}
# linears rebuilt from float weights after loading (prepacked or quantized): swapped whole
# swapped whole by an update (their weights are not parameters to copy into)
PACKED_LINEARS = (PrepackedLinear, Int8Linear, GroupedLinear, FixedOrderLinear, PackedEmbedding)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a trainer broadcasts: its checkpoint name, dtype (a `DTYPES` name) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def parse(cls, names: object, dtypes: object, shapes: object) -> list[TensorSpec]:
        """SGLang's `names`, `dtypes` (`"bfloat16"` or `"torch.bfloat16"`) and `shapes`, one
        entry per tensor; ValueError naming what is wrong."""
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ValueError("names, dtypes and shapes must be lists")
        if not len(names) == len(dtypes) == len(shapes) or not names:
            raise ValueError("names, dtypes and shapes must be one entry per tensor, at least one")
        if len(set(map(str, names))) != len(names):
            raise ValueError("a tensor is named twice in names")
        specs = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            dtype = dtype.removeprefix("torch.") if isinstance(dtype, str) else dtype
            if not isinstance(name, str) or dtype not in DTYPES:
                raise ValueError(f"tensor {name!r}: a string name and a dtype of {list(DTYPES)}")
            if not isinstance(shape, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
            ):
                raise ValueError(f"tensor {name!r}: its shape must be a list of sizes")
            specs.append(cls(name, dtype, tuple(shape)))
        return specs

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=DTYPES[self.dtype])


def check_same_architecture(served: PretrainedConfig, folder: Path) -> None:
    """ValueError naming each architecture field in which `folder`'s config.json differs from the
    served model's config (`served`); a folder without config.json is refused too."""
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json: not a model checkpoint folder")
    from transformers import AutoConfig  # its import is a quarter second of every start

    new = AutoConfig.from_pretrained(folder)
    differ = [
        f"{name}: {getattr(new, name, None)!r} (served: {getattr(served, name, None)!r})"
        for name in ARCHITECTURE_FIELDS
        if getattr(new, name, None) != getattr(served, name, None)
    ]
    if differ:
        raise ValueError(f"the checkpoint is another architecture: {'; '.join(differ)}")


@torch.no_grad()
def adopt_weights(live: nn.Module, staged: nn.Module) -> None:
    """Move `staged`'s weights into `live` (the same architecture, built and quantized the same
    way): float parameters are copied in place, so what holds their storage (CUDA graphs, tied
    embeddings) reads the new values; packed linears are swapped whole. An adapter's `LoraSite`
    keeps its adapters and takes the new base. Computed buffers (rotary tables) stay."""
    for name, param in live._parameters.items():
        if param is not None:
            new_param = staged._parameters[name]
            assert new_param is not None  # the same architecture: the same parameters
            param.copy_(new_param)
    for name, child in live.named_children():
        new = getattr(staged, name)
        if isinstance(child, LoraSite):
            child.base = _adopt_child(child.base, new)
        else:
            setattr(live, name, _adopt_child(child, new))


def _adopt_child(live: nn.Module, staged: nn.Module) -> nn.Module:
    """What `live`'s place holds after the update: `staged` for a packed linear, else `live`
    with `staged`'s weights copied in."""
    if isinstance(staged, PACKED_LINEARS):
        return staged
    adopt_weights(live, staged)
    return live
