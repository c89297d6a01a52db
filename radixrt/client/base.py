"""What the ZeroMQ and HTTP endpoints share: the request options, the prompt's shapes, and the
`Endpoint` base that turns a call's prompts and options into request maps. `connect(url)`
(client/endpoint.py) picks the sibling for a URL."""

from __future__ import annotations

import inspect
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, overload

from radixrt.protocol import (
    CheckInvariants,
    ContinueGeneration,
    ControlOp,
    DestroyWeightsUpdateGroup,
    FlushCache,
    GenerateOptions,
    GetWeightVersion,
    InitWeightsUpdateGroup,
    ListLoraAdapters,
    LoadLoraAdapter,
    MemorySnapshot,
    Metrics,
    PauseGeneration,
    ReleaseMemoryOccupation,
    ResumeMemoryOccupation,
    Stats,
    UnloadLoraAdapter,
    Unpin,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    option_fields,
    spec_of,
)

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Prompt: TypeAlias = str | list[int]
"""One prompt: its text, or its token ids."""
Prompts: TypeAlias = Prompt | list[Prompt]
"""A call's prompts: one, or a list of them."""
TokenIds: TypeAlias = list[int] | list[list[int]]
"""A call's `input_ids`: one prompt's token ids, or each prompt's."""
Params: TypeAlias = dict[str, Any]
"""A request's sampling parameters (`SamplingParams`' fields by name)."""
Result: TypeAlias = dict[str, Any]
"""One sample: `{"text", "output_ids", "meta_info"}` (and `"embedding"` from an
--is-embedding server)."""
Results: TypeAlias = Result | list[Any]
"""A call's result: one prompt's `Result` (a list of n when n > 1), or for a list of prompts a
list of those."""
Chunk: TypeAlias = dict[str, Any]
"""One streamed chunk: `{"delta", "token_ids", "index", "finished"}`, or with `finished` a
sample's `Result`."""


@dataclass(frozen=True, kw_only=True)
class RequestOptions(GenerateOptions):
    """A call's request fields (`GenerateOptions`, docs/protocol.md's table: `cache_salt`,
    `priority`, `timeout`, `lora_path`, ...) and `api_key`, this request's own key naming its
    tenant (default: the endpoint's; over HTTP it goes as the bearer token). None: not sent.
    Keyword construction only."""

    api_key: str | None = None

    def fields(self) -> dict[str, Any]:
        """The request fields set, and the key when set: what a ZeroMQ map carries."""
        key = {"api_key": self.api_key} if self.api_key is not None else {}
        return {**self.wire(), **key}

    def pin_fields(self) -> dict[str, Any]:
        """What a pin carries: the namespace options set (a pin has no priority or deadline),
        and the key when set."""
        names = {f.name for f in option_fields() if spec_of(f).namespace} | {"api_key"}
        return {k: v for k, v in self.fields().items() if k in names}


def control_method(record: type[ControlOp]) -> Callable[..., Any]:
    """The endpoint method that sends `record`'s op: its arguments are the op's fields (by
    name, or positional in their declared order: SGLang's), its docstring the op's, its result
    the op's (`Endpoint.control`)."""

    def method(self: Endpoint, *args: Any, **kwargs: Any) -> Any:
        return self.control(record(*args, **kwargs))

    fields = inspect.signature(record).parameters.values()
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = inspect.Signature([self_param, *fields])  # type: ignore[attr-defined]
    method.__name__ = method.__qualname__ = record.op
    method.__doc__ = record.__doc__
    return method


class Endpoint(ABC):
    """A connection to `radixrt serve` (or a router): the user API, blocking, streaming and
    asyncio; `ZmqEndpoint` and `HttpEndpoint` implement it over their transports. `cache_salt`,
    `priority` and `lora_path` apply to every request sent through it (a frontend program's
    backend option); `options=` or `lora_path=` on a call overrides them. `timeout` bounds each
    call (seconds; None waits)."""

    def __init__(
        self,
        url: str,
        timeout: float | None,
        cache_salt: str | None = None,
        priority: int | None = None,
        lora_path: str | None = None,
    ):
        self.url = url
        self.timeout = timeout
        self.options = RequestOptions(cache_salt=cache_salt, priority=priority, lora_path=lora_path)
        self._model_info: dict[str, Any] | None = None

    # ---- generation --------------------------------------------------------------------------
    @overload
    def generate(
        self,
        prompt: Prompts | None = None,
        sampling_params: Params | list[Params] | None = None,
        input_ids: TokenIds | None = None,
        rid: str | list[str] | None = None,
        stream: Literal[False] = False,
        options: RequestOptions | None = None,
        lora_path: str | list[str] | None = None,
    ) -> Results: ...

    @overload
    def generate(
        self,
        prompt: Prompts | None = None,
        sampling_params: Params | list[Params] | None = None,
        input_ids: TokenIds | None = None,
        rid: str | list[str] | None = None,
        *,
        stream: Literal[True],
        options: RequestOptions | None = None,
        lora_path: str | list[str] | None = None,
    ) -> Generator[Chunk, None, None]: ...

    @abstractmethod
    def generate(
        self,
        prompt: Prompts | None = None,
        sampling_params: Params | list[Params] | None = None,
        input_ids: TokenIds | None = None,
        rid: str | list[str] | None = None,
        stream: bool = False,
        options: RequestOptions | None = None,
        lora_path: str | list[str] | None = None,
    ) -> Results | Generator[Chunk, None, None]:
        """One prompt -> `{"text", "output_ids", "meta_info"}` (a list of n when n > 1); a list
        of prompts -> a list. With `stream=True` (one prompt), a generator of chunks
        `{"delta", "token_ids", "index", "finished"}`, the last per sample with the result;
        closing it (`close`) before its end aborts the request. `lora_path` names the adapter
        of every prompt, or (a list) of each one."""

    @abstractmethod
    async def async_generate(
        self,
        prompt: Prompts | None = None,
        sampling_params: Params | list[Params] | None = None,
        input_ids: TokenIds | None = None,
        rid: str | list[str] | None = None,
        options: RequestOptions | None = None,
    ) -> Results: ...

    @abstractmethod
    def async_stream(
        self,
        prompt: Prompt | None = None,
        sampling_params: Params | None = None,
        input_ids: list[int] | None = None,
        rid: str | None = None,
        options: RequestOptions | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """`async for chunk in endpoint.async_stream(...)`: the streamed chunks of one prompt;
        closing it (`aclose`) before its end aborts the request."""

    @abstractmethod
    def abort(self, rid: str) -> None: ...

    def encode(self, prompt: Prompts | None = None, input_ids: TokenIds | None = None) -> Results:
        """An --is-embedding server's vector of each prompt (SGLang's `Engine.encode`): one
        prompt -> `{"embedding", "meta_info", ...}`, a list of prompts -> a list."""
        return self.generate(prompt, {"max_new_tokens": 0}, input_ids=input_ids)

    # ---- control ops: one method each, its arguments the op's fields -------------------------
    @abstractmethod
    def control(self, op: ControlOp) -> Any:
        """Send the control op `op` (`protocol.CONTROL_OPS`) with this endpoint's key (its admin
        key for an admin op); its result, or its refusal raised as a request's would be."""

    stats = control_method(Stats)
    metrics = control_method(Metrics)
    flush_cache = control_method(FlushCache)
    check_invariants = control_method(CheckInvariants)
    memory_snapshot = control_method(MemorySnapshot)
    unpin = control_method(Unpin)
    load_lora_adapter = control_method(LoadLoraAdapter)
    unload_lora_adapter = control_method(UnloadLoraAdapter)
    list_lora_adapters = control_method(ListLoraAdapters)
    update_weights_from_disk = control_method(UpdateWeightsFromDisk)
    init_weights_update_group = control_method(InitWeightsUpdateGroup)
    update_weights_from_distributed = control_method(UpdateWeightsFromDistributed)
    destroy_weights_update_group = control_method(DestroyWeightsUpdateGroup)
    pause_generation = control_method(PauseGeneration)
    continue_generation = control_method(ContinueGeneration)
    release_memory_occupation = control_method(ReleaseMemoryOccupation)
    resume_memory_occupation = control_method(ResumeMemoryOccupation)

    def get_weight_version(self) -> str:
        """The weights' version (docs/rl.md)."""
        version: str = self.control(GetWeightVersion())["weight_version"]
        return version

    @abstractmethod
    def health(self, timeout: float | None = None) -> bool: ...

    @abstractmethod
    def pin(self, pin_id: str, prompt: Prompt, options: RequestOptions | None = None) -> int:
        """Keep the cached prefix of `prompt` (under the options' cache salt) from eviction until
        `unpin`; returns tokens pinned."""

    @abstractmethod
    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The runtime's tokenization of `text`: as a prompt's (`prompt_ids`: the model's BOS
        where it asks for one) with `add_special_tokens`, else the text's own tokens."""

    @property
    def model_info(self) -> dict[str, Any]:
        """The server's `model_info`, asked once."""
        if self._model_info is None:
            self._model_info = self._fetch_model_info()
        return self._model_info

    @abstractmethod
    def _fetch_model_info(self) -> dict[str, Any]: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- plumbing ----------------------------------------------------------------------------
    def _requests(
        self,
        prompt: Prompts | None,
        input_ids: TokenIds | None,
        sampling_params: Params | list[Params] | None,
        rid: str | list[str] | None,
        options: RequestOptions | None,
    ) -> tuple[list[dict[str, Any]], bool]:
        """The request maps of one call (one per prompt) under these options over the
        endpoint's, and whether the call gave a single prompt."""
        items, single, key = normalize_prompt(prompt, input_ids)
        fields = (options or RequestOptions()).over(self.options).fields()
        params = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        )
        rids = [rid] if isinstance(rid, str) else rid or [uuid.uuid4().hex for _ in items]
        if len(params) != len(items) or len(rids) != len(items):
            raise ValueError("sampling_params and rid must be one value or one per prompt")
        return [
            {"rid": r, "sampling_params": p or {}, key: item, **fields}
            for r, item, p in zip(rids, items, params)
        ], single


def normalize_prompt(
    prompt: Prompts | None, input_ids: TokenIds | None
) -> tuple[Sequence[Prompt], bool, str]:
    """The prompts of a call as a list, whether it gave one, and the field they go in."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt or input_ids")
    if prompt is not None:
        if _is_token_ids(prompt):
            return [prompt], True, "input_ids"
        items = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(items, list) or not items or not all(isinstance(p, str) for p in items):
            raise ValueError(
                "prompt must be a string, a list of token ids, or a non-empty list of strings"
            )
        return items, isinstance(prompt, str), "text"
    assert input_ids is not None, "exactly one of the two was given"
    if is_batch(input_ids):
        return input_ids, False, "input_ids"
    return [input_ids], True, "input_ids"


def _is_token_ids(prompt: Prompts) -> TypeIs[list[int]]:
    """Whether `prompt` is one prompt's token ids (a list of ints, not of prompts)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


def is_batch(input_ids: TokenIds) -> TypeIs[list[list[int]]]:
    """Whether `input_ids` are several prompts' (a list of lists), not one prompt's."""
    return isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
