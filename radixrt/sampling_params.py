"""Per-request sampling parameters, validated at the door."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from radixrt.structured.grammar import CONSTRAINT_KINDS

_INT_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "top_k",
    "n",
    "top_logprobs_num",
    "logprob_start_len",
)
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "return_logprob")

# The smallest temperature that still samples. float32 keeps far smaller numbers, but logits
# divided by less than this overflow to inf (and then NaN) before the softmax; 0 is greedy.
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 1e-2
MAX_STOP_STRINGS = 32  # every stop string is searched for after every token
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_SEED = (1 << 63) - 1  # torch generators take 64-bit seeds; n samples add their index
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, +100 all but forces it
MAX_LOGIT_BIAS_ENTRIES = 1024
# generation_config.json's fields a request's unset parameters take (vLLM's set)
GENERATION_CONFIG_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # prompt logprobs from this position; -1: none
    regex: str | None = None  # constraints (at most one): see radixrt/structured/
    json_schema: str | dict | None = None
    choices: list[str] | None = None
    dtype: str | None = None  # "int", "float", "bool" or "str"
    ebnf: str | None = None  # a GBNF grammar (llama.cpp's dialect)
    lark: str | None = None  # a Lark grammar (llguidance's dialect)
    # token id -> added to its logit before sampling; ids may arrive as strings (JSON's keys)
    logit_bias: dict[int, float] | None = None

    @classmethod
    def from_dict(
        cls, params: dict[str, Any] | None, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """Validated parameters: those given, else `defaults` (the model's generation config),
        else the fields' own defaults."""
        params = {**(defaults or {}), **(params or {})}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(params) - known
        if unknown:
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        if isinstance(params.get("stop_token_ids"), int):
            params["stop_token_ids"] = [params["stop_token_ids"]]
        if params.get("logit_bias") is not None:
            params["logit_bias"] = _token_id_keys(params["logit_bias"])
        sp = cls(**params)
        sp.validate()
        return sp

    def validate(self) -> None:
        for name in _INT_FIELDS:
            _check_type(name, getattr(self, name), int)
        for name in _FLOAT_FIELDS:
            _check_type(name, getattr(self, name), (int, float))
        for name in _BOOL_FIELDS:
            _check_type(name, getattr(self, name), bool)
        if self.seed is not None:
            _check_type("seed", self.seed, int)
            _check_range("seed", self.seed, 0, MAX_SEED - 64)
        self._validate_stops()
        self._validate_logit_bias()
        _check_range("max_new_tokens", self.max_new_tokens, 0, 1 << 20)
        _check_range("min_new_tokens", self.min_new_tokens, 0, self.max_new_tokens)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        # dividing logits by less than this overflows them, as a temperature below the floor does
        _check_range("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, 2.0)
        _check_range("n", self.n, 1, 64)
        _check_range("top_logprobs_num", self.top_logprobs_num, 0, 20)
        _check_range("logprob_start_len", self.logprob_start_len, -1, 1 << 30)
        constraints = self.constraint()
        if constraints is not None:
            kind, value = constraints
            if kind in ("regex", "dtype", "ebnf", "lark") and not isinstance(value, str):
                raise ValueError(f"{kind} must be a string")
            if kind == "json_schema" and not isinstance(value, (str, dict)):
                raise ValueError("json_schema must be a JSON string or a map")
            if kind == "choices" and (
                not isinstance(value, list)
                or not value
                or not all(isinstance(c, str) for c in value)
            ):
                raise ValueError("choices must be a non-empty list of strings")

    def _validate_stops(self) -> None:
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters"
            )
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative ints")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias must be a map of at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases"
            )
        for token, bias in self.logit_bias.items():
            _check_type("logit_bias token id", token, int)
            _check_type(f"logit_bias[{token}]", bias, (int, float))
            _check_range(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """What only the model can bound: `top_k`, the stop token ids and the biased token ids
        are within its vocabulary (an id past it would index past the logits)."""
        if self.top_k > vocab_size:
            raise ValueError(
                f"top_k must be at most the vocabulary size {vocab_size}, got {self.top_k}"
            )
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.logit_bias or ()),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab_size}), got {bad[:4]}")

    def constraint(self) -> tuple[str, object] | None:
        """The one structured-output constraint, as (kind, value), or None."""
        given = [(k, getattr(self, k)) for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of {', '.join(CONSTRAINT_KINDS)} (got {[k for k, _ in given]})"
            )
        return given[0] if given else None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _token_id_keys(bias: Any) -> Any:
    """OpenAI's `logit_bias` keys are token ids written as strings (JSON maps have string keys):
    "42" -> 42; anything else is left for `validate` to refuse by name."""
    if not isinstance(bias, dict):
        return bias
    return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in bias.items()}


def _check_type(name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ValueError(
            f"{name} must be of type {getattr(kind, '__name__', 'number')}, got {value!r}"
        )


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def generation_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults in a model's generation_config.json (as parsed): only the
    `GENERATION_CONFIG_FIELDS` it sets, as vLLM reads them (`do_sample` is not read), with
    transformers' top_k 0 ("off") as radixrt's -1. ValueError, naming the file, when they do
    not validate."""
    defaults = {k: config[k] for k in GENERATION_CONFIG_FIELDS if config.get(k) is not None}
    if defaults.get("top_k") == 0:
        defaults["top_k"] = -1
    try:
        SamplingParams.from_dict(defaults)
    except ValueError as e:
        raise ValueError(
            f"generation_config.json: {e} (--generation-config ignore serves without it)"
        ) from None
    return defaults
