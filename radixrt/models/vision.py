"""The vision transformers (ViT) of the vision-language families: CLIP's and SigLIP's vision
towers, as transformers' `CLIPVisionModel` and `SiglipVisionModel` compute them, up to the hidden
states a family reads.

An image's pixel values [3, S, S] (S: the config's `image_size`) are cut into (S / P)^2 patches
of P x P (a convolution of stride P), each projected to the tower's width; CLIP puts a learned
class embedding before them; a learned position embedding is added to each; CLIP layer-norms the
sum (`pre_layrnorm`); then every encoder layer runs a pre-norm block: x + attention(norm(x)),
then x + MLP(norm(x)), the attention bidirectional over one image's tokens, the MLP two biased
linears around the config's activation. Hidden state 0 is the encoder's input, hidden state i
the output of layer i (transformers' `hidden_states`); a vision-language model reads one or
several of them (LLaVA's `vision_feature_layer`), never the tower's pooled output, so the tower
is built only as deep as the deepest state asked for, and the tensors past it (later layers, the
post-layernorm, SigLIP's pooling head) are counted read without being loaded.

Images are attended one by one (a batch dimension of images, no mask, no KV cache): not the
decoder's attention backend, whose pool and causal masks serve tokens of text. The tower's
weights are whole on every rank: they are small beside the text model's (CLIP ViT-L/14 is 0.3B).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from radixrt.models.interface import WeightSource


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: x * sigmoid(1.702 x), as transformers' `QuickGELUActivation`."""
    return x * torch.sigmoid(1.702 * x)


# the activations of the towers' MLPs and of the projectors after them, by transformers' names
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation transformers names `name`; ValueError naming the supported ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


@dataclass(frozen=True)
class TowerKind:
    """What one family's vision tower has that another's lacks.

    class_token: a learned embedding before the patches (CLIP's `class_embedding`), with a
        position of its own.
    pre_norm: a LayerNorm over the embeddings before the first layer (CLIP's `pre_layrnorm`).
    patch_bias: the patch convolution has a bias (SigLIP's).
    unread: the checkpoint's tensors (under the tower's prefix) that no hidden state depends on:
        the post-layernorm, which only the pooled output passes through.
    head: the tensors of the pooling head (SigLIP's attention pooling, present where the config
        sets `vision_use_head`), read by nothing a vision-language model uses.
    """

    class_token: bool
    pre_norm: bool
    patch_bias: bool
    unread: tuple[str, ...] = ("post_layernorm.weight", "post_layernorm.bias")
    head: tuple[str, ...] = ()


# by the vision config's `model_type`
TOWERS = {
    "clip_vision_model": TowerKind(class_token=True, pre_norm=True, patch_bias=False),
    "siglip_vision_model": TowerKind(
        class_token=False,
        pre_norm=False,
        patch_bias=True,
        head=(
            "head.probe",
            "head.attention.in_proj_weight",
            "head.attention.in_proj_bias",
            "head.attention.out_proj.weight",
            "head.attention.out_proj.bias",
            "head.layernorm.weight",
            "head.layernorm.bias",
            "head.mlp.fc1.weight",
            "head.mlp.fc1.bias",
            "head.mlp.fc2.weight",
            "head.mlp.fc2.bias",
        ),
    ),
}

# an encoder layer's tensors as the checkpoint names them, under `encoder.layers.N.`: q, k and v
# are read into one fused projection (`VisionAttention.qkv_proj`), the rest by their own names
LAYER_TENSORS = tuple(
    f"{module}.{kind}"
    for module in (
        "layer_norm1",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.out_proj",
        "layer_norm2",
        "mlp.fc1",
        "mlp.fc2",
    )
    for kind in ("weight", "bias")
)


def tower_kind(config: PretrainedConfig) -> TowerKind:
    """The kind of tower a vision config describes; ValueError naming the supported ones."""
    kind = TOWERS.get(getattr(config, "model_type", ""))
    if kind is None:
        raise ValueError(
            f"vision tower {getattr(config, 'model_type', None)!r} is not supported; "
            f"supported: {sorted(TOWERS)}"
        )
    return kind


class FeedForward(nn.Module):
    """fc2(act(fc1(x))), both linears with biases or both without: a tower layer's MLP, and a
    projector from the tower's width into the text model's."""

    def __init__(self, dims: tuple[int, int, int], act: str, bias: bool = True):
        """`dims`: (input, hidden, output) widths; `act`: transformers' name of the activation."""
        super().__init__()
        d_in, hidden, d_out = dims
        self.fc1 = nn.Linear(d_in, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, d_out, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class VisionAttention(nn.Module):
    """Multi-head attention over each image's tokens, every token seeing every other: q, k and v
    from one fused projection (biased), scaled by 1/sqrt(head_dim), and the output projection."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(
                f"hidden_size {width} is not a multiple of num_attention_heads {heads}"
            )
        self.heads, self.head_dim = heads, width // heads
        self.qkv_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [images, tokens, width] -> the same shape."""
        b, t, width = x.shape
        q, k, v = self.qkv_proj(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)  # [images, heads, tokens, head_dim]
        out: torch.Tensor = self.out_proj(o.transpose(1, 2).reshape(b, t, width))
        return out


class EncoderLayer(nn.Module):
    """x + attention(layer_norm1(x)), then x + mlp(layer_norm2(x))."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        width, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(width, eps=eps)
        self.self_attn = VisionAttention(width, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = FeedForward((width, config.intermediate_size, width), config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        out: torch.Tensor = x + self.mlp(self.layer_norm2(x))
        return out


class PatchEmbedding(nn.Module):
    """Pixel values [images, 3, S, S] -> [images, tokens, width]: the patches' projections (the
    class embedding first where the tower has one), each plus its position's embedding."""

    def __init__(self, config: PretrainedConfig, kind: TowerKind):
        super().__init__()
        width, self.patch, self.image_size = (
            config.hidden_size,
            config.patch_size,
            config.image_size,
        )
        self.patch_embedding = nn.Conv2d(
            config.num_channels, width, self.patch, stride=self.patch, bias=kind.patch_bias
        )
        self.class_embedding = nn.Parameter(torch.empty(width)) if kind.class_token else None
        self.tokens: int = (self.image_size // self.patch) ** 2 + kind.class_token
        self.position_embedding = nn.Embedding(self.tokens, width)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"images of {tuple(pixels.shape[-2:])} pixels; the tower takes "
                f"{self.image_size} x {self.image_size}"
            )
        weight = self.patch_embedding.weight
        x: torch.Tensor = self.patch_embedding(pixels.to(weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionEncoder(nn.Module):
    """The first `depth` encoder layers of the tower."""

    def __init__(self, config: PretrainedConfig, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(depth))

    def forward(self, x: torch.Tensor, wanted: tuple[int, ...]) -> list[torch.Tensor]:
        """The hidden states `wanted` (0: `x` itself, i: layer i's output), in their order."""
        states = {0: x}
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in wanted]


class VisionTower(nn.Module):
    """A CLIP or SigLIP vision tower (`TOWERS`, by the config's `model_type`), built `depth`
    layers deep: the hidden states 0..depth are what it computes. Its modules are named as the
    checkpoint names its tensors (under the tower's prefix), but for each layer's fused q/k/v."""

    def __init__(self, config: PretrainedConfig, depth: int):
        super().__init__()
        self.kind = tower_kind(config)
        layers: int = config.num_hidden_layers
        if not 0 <= depth <= layers:
            raise ValueError(f"a tower of {layers} layers has no hidden state {depth}")
        self.config, self.num_layers, self.depth = config, layers, depth
        self.embeddings = PatchEmbedding(config, self.kind)
        self.pre_layrnorm = (  # sic: the checkpoint's name
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            if self.kind.pre_norm
            else None
        )
        self.encoder = VisionEncoder(config, depth)

    @property
    def tokens(self) -> int:
        """The tokens of each hidden state: every patch, and the class token where there is one."""
        return self.embeddings.tokens

    def forward(self, pixels: torch.Tensor, wanted: tuple[int, ...]) -> list[torch.Tensor]:
        """Pixel values [images, 3, S, S] -> the hidden states `wanted` (each in 0..depth), each
        [images, tokens, width], in the parameters' dtype."""
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states: list[torch.Tensor] = self.encoder(x, wanted)
        return states

    def load_weights(self, reader: WeightSource, prefix: str) -> None:
        """Every parameter from the checkpoint's tensors under `prefix` (each layer's q, k and v
        stacked into its fused projection); the tensors no hidden state up to `depth` reads (the
        layers past it, the post-layernorm, a pooling head) checked present and counted read.
        ValueError for a tensor missing or of the wrong shape."""
        width = self.config.hidden_size
        for name, param in self.named_parameters():
            layer, _, rest = name.rpartition("self_attn.qkv_proj.")
            if layer:
                parts = [(f"{prefix}{layer}self_attn.{p}_proj.{rest}", 0, width) for p in "qkv"]
                reader.stack_rows(param.data, parts)
            else:
                reader.copy_rows(param.data, prefix + name)
        skipped = [
            f"encoder.layers.{i}.{t}"
            for i in range(self.depth, self.num_layers)
            for t in LAYER_TENSORS
        ]
        if getattr(self.config, "vision_use_head", False):
            skipped += self.kind.head
        for name in [*skipped, *self.kind.unread]:
            reader.skip(prefix + name)
