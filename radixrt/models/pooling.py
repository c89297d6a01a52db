"""`--is-embedding`: how a decoder model's prompt becomes one vector, as its sentence-transformers
files define it (Qwen3-Embedding, e5-mistral and gte-Qwen ship them): the final-norm hidden state of
the last prompt token (`last`) or the mean over every prompt token (`mean`), then L2-normalized when
the files list a `Normalize` module. A folder without those files gets last-token pooling,
normalized: what decoder embedding models use and what SGLang and vLLM default to.

`matryoshka` names the output sizes a request's `dimensions` may ask for (the model's config lists
them as `matryoshka_dimensions`, or says `is_matryoshka`; SGLang reads the same two keys).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# sentence-transformers' Pooling config keys -> radixrt's modes
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class Pooling:
    """`mode`: last or mean; `normalize`: L2 after pooling; `size`: the vector's length (the
    hidden size); `matryoshka`: the sizes `dimensions` may take (empty: any up to `size`), or None
    when the model cannot be truncated."""

    mode: str
    normalize: bool
    size: int
    matryoshka: tuple[int, ...] | None

    @classmethod
    def of_model(cls, folder: Path, config: Any) -> Pooling:
        """The pooling `folder`'s sentence-transformers files define (ValueError naming a mode
        radixrt does not serve)."""
        mode, normalize = "last", True
        modules_file = folder / "modules.json" if folder.is_dir() else None
        if modules_file is not None and modules_file.exists():
            modules = json.loads(modules_file.read_text())
            kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
            normalize = "Normalize" in kinds
            if "Pooling" in kinds:
                mode = _pooling_mode(folder / kinds["Pooling"] / "config.json")
        dims = getattr(config, "matryoshka_dimensions", None)
        matryoshka = (
            tuple(int(d) for d in dims)
            if dims
            else ()
            if getattr(config, "is_matryoshka", False)
            else None
        )
        return cls(mode, normalize, int(config.hidden_size), matryoshka)

    def info(self) -> dict[str, Any]:
        """What `model_info` says of it (the HTTP gateway truncates by `matryoshka`)."""
        return {
            "pooling": self.mode,
            "normalize": self.normalize,
            "size": self.size,
            "matryoshka": None if self.matryoshka is None else list(self.matryoshka),
        }

    def finish(self, pooled: torch.Tensor) -> list[float]:
        """The pooled float vector as the reply carries it."""
        vector = pooled.float()
        if self.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return vector.tolist()


def _pooling_mode(config_file: Path) -> str:
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    chosen = [key for key, on in config.items() if key.startswith("pooling_mode_") and on]
    if not chosen:
        return "last"
    if len(chosen) > 1 or chosen[0] not in _MODES:
        raise ValueError(
            f"--is-embedding serves last-token or mean pooling; {config_file} asks for "
            f"{', '.join(chosen)}"
        )
    return _MODES[chosen[0]]
