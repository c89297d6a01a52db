"""Per-request sampling parameters, validated at the door."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import regex

from radixrt.structured.grammar import CONSTRAINT_KINDS
from radixrt.structured.structural_tag import structural_tag_lark

NUMBER = (int, float)  # a float parameter takes an int too (JSON writes 1.0 as 1)
# The smallest temperature that still samples. float32 keeps far smaller numbers, but logits
# divided by less than this overflow to inf (and then NaN) before the softmax; 0 is greedy.
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 1e-2
MAX_STOP_STRINGS = 32  # every stop string is searched for after every token
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_REGEXES = 8  # each is searched for in the text after every token
# SGLang's names for radixrt's parameters
_ALIASES = {"sampling_seed": "seed"}
# SGLang's sampling parameters radixrt cannot honour: refused by name, with why, unless null
_UNSERVED = {
    "custom_params": "it feeds a custom logit processor, and radixrt never runs code a request "
    "sends",
}
MAX_SEED = (1 << 63) - 1  # torch generators take 64-bit seeds; n samples add their index
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, +100 all but forces it
MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """How one sampling parameter is checked and where it travels besides `sampling_params`.

    `doc`: its line in docs/protocol.md's table. `kind`: the type its value must have (None:
    its own code in `validate` checks it). `openai`: its name as a field of the OpenAI bodies
    (/v1/completions, /v1/chat/completions; None: not one), `body` its type there when not the
    declared one. `native`: the native /generate takes it top level too (SGLang's logprob
    fields). `generation_config`: a model's generation_config.json may set its default (vLLM's
    set)."""

    doc: str
    kind: type | tuple[type, ...] | None = None
    openai: str | None = None
    body: Any = None
    native: bool = False
    generation_config: bool = False


def param(
    default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **spec: Any
) -> Any:
    """A `SamplingParams` field: its default (or `factory`), its `ParamSpec(**spec)`."""
    return field(default=default, default_factory=factory, metadata={"spec": ParamSpec(**spec)})


def param_spec(f: dataclasses.Field[Any]) -> ParamSpec:
    spec: ParamSpec = f.metadata["spec"]
    return spec


@dataclass(kw_only=True)
class SamplingParams:
    """A request's `sampling_params`, each parameter declared once with its `ParamSpec`: the
    OpenAI bodies' sampling fields, the native /generate's top-level logprob fields, the
    generation_config.json defaults and docs/protocol.md's table derive from here. Keyword
    construction only."""

    max_new_tokens: int = param(
        128,
        kind=int,
        generation_config=True,
        doc="tokens generated at most; 0 scores the prompt (prefill only, with `return_logprob` "
        "and `logprob_start_len` for its logprobs)",
    )
    min_new_tokens: int = param(
        0, kind=int, openai="min_tokens", doc="tokens generated before a stop may end it"
    )
    temperature: float = param(
        1.0, kind=NUMBER, openai="temperature", generation_config=True, doc="0 = greedy"
    )
    top_p: float = param(
        1.0, kind=NUMBER, openai="top_p", generation_config=True, doc="nucleus sampling's mass"
    )
    top_k: int = param(-1, kind=int, openai="top_k", generation_config=True, doc="-1 = off")
    min_p: float = param(
        0.0,
        kind=NUMBER,
        openai="min_p",
        generation_config=True,
        doc="least probability, relative to the top token's",
    )
    frequency_penalty: float = param(
        0.0, kind=NUMBER, openai="frequency_penalty", doc="OpenAI's, per occurrence in the output"
    )
    presence_penalty: float = param(
        0.0, kind=NUMBER, openai="presence_penalty", doc="OpenAI's, once per token in the output"
    )
    repetition_penalty: float = param(
        1.0,
        kind=NUMBER,
        openai="repetition_penalty",
        generation_config=True,
        doc="divides (multiplies, when negative) the logits of tokens seen in prompt or output",
    )
    stop: list[str] = param(
        factory=list, openai="stop", body=str | list[str], doc="a string or a list of them"
    )
    stop_token_ids: list[int] = param(
        factory=list, openai="stop_token_ids", doc="token ids that end the output"
    )
    stop_regex: list[str] = param(  # checked with the stops
        factory=list,
        doc="SGLang's: a regex or a list of them; the output ends at the first match in its "
        "text, cut there",
    )
    no_stop_trim: bool = param(
        False, kind=bool, doc="the stop string, regex match or stop token stays in the text"
    )
    ignore_eos: bool = param(
        False,
        kind=bool,
        openai="ignore_eos",
        doc="the model's end-of-sequence tokens do not stop it",
    )
    skip_special_tokens: bool = param(
        True, kind=bool, openai="skip_special_tokens", doc="special tokens are left out of the text"
    )
    spaces_between_special_tokens: bool = param(
        True,
        kind=bool,
        doc="with special tokens kept, spaces between them (tokenizers with this option; fast "
        "ones have none and ignore it, as in SGLang)",
    )
    seed: int | None = param(  # checked with its range
        None, openai="seed", doc="makes sampling repeatable (sample i of n uses seed + i)"
    )
    n: int = param(1, kind=int, openai="n", doc="samples of the prompt")
    return_logprob: bool = param(
        False, kind=bool, native=True, doc="the output tokens' logprobs in `meta_info`"
    )
    top_logprobs_num: int = param(
        0,
        kind=int,
        native=True,
        doc="the top tokens' logprobs at each output position (with `logprob_start_len`, at the "
        "prompt's positions too)",
    )
    logprob_start_len: int = param(
        -1, kind=int, native=True, doc="prompt logprobs from this position; -1: none"
    )
    # constraints (at most one): see radixrt/structured/
    regex: str | None = param(None, openai="regex", doc="the output matches this regex")
    json_schema: str | dict[str, Any] | None = param(
        None, openai="json_schema", body=str | dict[str, Any], doc="a JSON schema, as text or a map"
    )
    choices: list[str] | None = param(None, doc="the output is one of these strings")
    dtype: str | None = param(
        None, doc='the output is a JSON value of this type: `"int"`, `"float"`, `"bool"` or `"str"`'
    )
    ebnf: str | None = param(None, openai="ebnf", doc="a GBNF grammar (llama.cpp's dialect)")
    lark: str | None = param(None, openai="lark", doc="a Lark grammar (llguidance's dialect)")
    max_reasoning_tokens: int | None = param(
        None,
        openai="max_reasoning_tokens",
        doc="with `--reasoning-parser`: the reasoning block's tokens at most, then `</think>` is "
        "forced and the answer (and its constraint) begins",
    )
    logit_bias: dict[int, float] | None = param(
        None,
        openai="logit_bias",
        body=dict[str, float],  # JSON writes a map's keys as strings
        doc="a map of token id, an int or its decimal string as JSON writes keys, to a bias "
        "added to that token's logit before any filter; -100 all but bans it, +100 all but "
        "forces it; logprobs stay the model's own",
    )

    @classmethod
    def from_dict(
        cls, params: dict[str, Any] | None, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """Validated parameters: those given, else `defaults` (the model's generation config),
        else the fields' own defaults."""
        params = {**(defaults or {}), **_sglang_names(params or {})}
        _structural_tag_as_lark(params)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(params) - known
        if unknown:
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
        for name in ("stop", "stop_token_ids", "stop_regex"):
            if name in params and params[name] is None:  # SGLang's clients send null for none
                del params[name]
            if name != "stop_token_ids" and isinstance(params.get(name), str):
                params[name] = [params[name]]
        if isinstance(params.get("stop_token_ids"), int):
            params["stop_token_ids"] = [params["stop_token_ids"]]
        if params.get("logit_bias") is not None:
            params["logit_bias"] = _token_id_keys(params["logit_bias"])
        sp = cls(**params)
        sp.validate()
        return sp

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            expected, value = param_spec(f).kind, getattr(self, f.name)
            if expected is not None and not (value is None and f.default is None):
                _check_type(f.name, value, expected)
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
        if self.max_reasoning_tokens is not None:
            _check_type("max_reasoning_tokens", self.max_reasoning_tokens, int)
            _check_range("max_reasoning_tokens", self.max_reasoning_tokens, 0, self.max_new_tokens)
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
        if not isinstance(self.stop_regex, list) or not all(
            isinstance(r, str) and r for r in self.stop_regex
        ):
            raise ValueError("stop_regex must be a non-empty string or a list of them")
        if len(self.stop_regex) > MAX_STOP_REGEXES or any(
            len(r) > MAX_STOP_CHARS for r in self.stop_regex
        ):
            raise ValueError(
                f"stop_regex takes at most {MAX_STOP_REGEXES} patterns of at most {MAX_STOP_CHARS} characters"
            )
        for pattern in self.stop_regex:
            try:
                regex.compile(pattern)  # as the engine matches it (engine/stop_strings.py)
            except regex.error as e:
                raise ValueError(f"stop_regex {pattern!r} is not a regex: {e}") from None

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


# generation_config.json's fields a request's unset parameters take (vLLM's set)
GENERATION_CONFIG_FIELDS = tuple(
    f.name for f in dataclasses.fields(SamplingParams) if param_spec(f).generation_config
)
# the constraint parameters (at most one per request) the OpenAI bodies carry
OPENAI_CONSTRAINTS = tuple(
    f.name
    for f in dataclasses.fields(SamplingParams)
    if f.name in CONSTRAINT_KINDS and param_spec(f).openai is not None
)


def openai_names() -> dict[str, str]:
    """Each sampling parameter the OpenAI bodies carry -> its name there."""
    return {
        f.name: spec.openai
        for f in dataclasses.fields(SamplingParams)
        if (spec := param_spec(f)).openai is not None
    }


def _sglang_names(params: dict[str, Any]) -> dict[str, Any]:
    """SGLang's parameter names as radixrt's (`sampling_seed` is `seed`); one it cannot honour
    is refused by name, with why, unless it is null (SGLang's clients send every field)."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name in _UNSERVED:
            if value is not None:
                raise ValueError(f"{name} is not supported: {_UNSERVED[name]}")
            continue
        own = _ALIASES.get(name, name)
        if own in out and value is not None and out[own] != value:
            raise ValueError(f"give one of {own} and {name}")
        if own not in out or value is not None:
            out[own] = value
    return out


def _structural_tag_as_lark(params: dict[str, Any]) -> None:
    """SGLang's `structural_tag` (in place) as the Lark grammar llguidance builds for it."""
    tag = params.pop("structural_tag", None)
    if tag is None:
        return
    if params.get("lark") is not None:
        raise ValueError("give one of structural_tag and lark")
    params["lark"] = structural_tag_lark(tag)


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
