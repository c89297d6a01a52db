"""A generation request as the scheduler sees it."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

from radixrt.engine.detokenizer import IncrementalDetokenizer
from radixrt.engine.images import ImageSpan
from radixrt.engine.stop_strings import StopRegexes, StopScanner
from radixrt.mem_cache.kv_events import Adapter
from radixrt.mem_cache.radix_cache import TreeNode
from radixrt.protocol import ErrorCode, GenerateOptions
from radixrt.sampling_params import SamplingParams
from radixrt.speculative import RequestDrafts

if TYPE_CHECKING:
    from radixrt.models.pooling import Pooling
    from radixrt.structured.compiler import CompileJob
    from radixrt.structured.grammar import GrammarGuide


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended. `stop` carries the matched token id or string, `length` the tokens
    generated, `abort` a message; an abort with an `error` code reaches the client as that
    error instead of a result (a constraint that does not compile)."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    error: ErrorCode | None = None

    @classmethod
    def stop(cls, matched: int | str) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def at_length(cls, length: int) -> FinishReason:
        return cls("length", length=length)

    @classmethod
    def abort(cls, message: str, error: ErrorCode | None = None) -> FinishReason:
        return cls("abort", message=message, error=error)

    def to_dict(self) -> dict[str, Any]:
        """The wire form, `meta_info["finish_reason"]`."""
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}


@dataclass(frozen=True)
class RequestScope:
    """Whom a request runs for and how urgently: its `tenant` (named by its API key; "" without
    a key file), its own `cache_salt`, its `priority` (an int; which end runs first is the
    server's choice), its `timeout` in seconds (None: no deadline), and the LoRA adapter it
    runs under (`lora_path`, "" for the base model; `lora_digest` names the adapter's weights,
    set by the scheduler)."""

    tenant: str = ""
    cache_salt: str = ""
    priority: int = 0
    timeout: float | None = None
    lora_path: str = ""
    lora_digest: str = ""

    @classmethod
    def from_fields(cls, tenant: str, fields: dict[str, Any]) -> RequestScope:
        """The scope a generate (or pin) map asks for: the `GenerateOptions` it holds, each
        not sent as its `unset` value (an option the engine does not read has no field here);
        a ValueError names a bad field."""
        resolved = GenerateOptions.from_wire(fields).resolved()
        mine = {f.name for f in dataclasses.fields(cls)}
        return cls(tenant=tenant, **{k: v for k, v in resolved.items() if k in mine})

    def capped(self, most_urgent: int | None, low_values_first: bool) -> RequestScope:
        """This scope with its priority clamped to its tenant's cap (`tenant:key:maxprio` in the
        key file; None: no cap). The cap bounds urgency: a ceiling when higher values run
        first, a floor under `--schedule-low-priority-values-first`."""
        if most_urgent is None:
            return self
        priority = (max if low_values_first else min)(self.priority, most_urgent)
        return dataclasses.replace(self, priority=priority)

    @property
    def salt(self) -> str:
        """The cache namespace: "" (shared) without a tenant, salt or adapter; else one string
        per (tenant, salt) pair, unambiguous because the tenant's length leads; under an adapter
        that string behind "L", the adapter's name (its length first) and its weights' digest,
        so a prefix is shared only within one adapter (and never with a reloaded one whose
        weights differ), and no tenant's salt can spell an adapter's namespace."""
        tenant = f"{len(self.tenant)}:{self.tenant}:{self.cache_salt}"
        if self.lora_path:
            return f"L{len(self.lora_path)}:{self.lora_path}:{self.lora_digest}:{tenant}"
        if not self.tenant and not self.cache_salt:
            return ""
        return tenant


DEFAULT_SCOPE = RequestScope()


def adapter_of_salt(salt: str) -> Adapter | None:
    """The adapter a cache namespace (`RequestScope.salt`) runs under, for KV events: its name,
    and as its id the first 32 bits of its weights' digest (stable across restarts)."""
    if not salt.startswith("L"):
        return None
    length, _, rest = salt[1:].partition(":")
    name = rest[: int(length)]
    digest = rest[int(length) + 1 :].partition(":")[0]
    return Adapter(int(digest[:8] or "0", 16), name)


def salt_is_private(salt: str) -> bool:
    """Whether a cache namespace (`RequestScope.salt`) is a tenant's or a `cache_salt`'s, under
    an adapter or not (whose token ids KV events keep to themselves): not the shared default's
    nor an adapter's alone."""
    if salt.startswith("L"):  # behind the adapter's name (its length first) and digest
        length, _, rest = salt[1:].partition(":")
        salt = rest[int(length) + 1 :].partition(":")[2]
    return salt not in ("", "0::")


@dataclass
class PromptLogprobs:
    """A request's prompt logprobs, kept as tensors until its reply is built (as Python pairs a
    long prompt's top-k would take about 100 bytes a value): per scored position the prompt
    token's logprob and id, and the `top_logprobs_num` best values and ids. Appended a chunk of
    positions at a time; how many values a request may ask for is capped at the door
    (`check_prompt_logprobs`)."""

    values: list[torch.Tensor] = field(default_factory=list)  # float32 [m] per chunk
    ids: list[torch.Tensor] = field(default_factory=list)  # int64 [m]
    top_values: list[torch.Tensor] = field(default_factory=list)  # float32 [m, k]
    top_ids: list[torch.Tensor] = field(default_factory=list)  # int64 [m, k]

    def add(self, values: torch.Tensor, ids: torch.Tensor, top: tuple[torch.Tensor, ...]) -> None:
        """One chunk: the prompt tokens' logprobs and ids, and (when asked) the top values and
        ids; all moved to the CPU (float32 holds a bf16 or float32 logprob exactly)."""
        self.values.append(values.float().cpu())
        self.ids.append(ids.cpu())
        if top:
            top_values, top_ids = top
            self.top_values.append(top_values.float().cpu())
            self.top_ids.append(top_ids.cpu())

    def chosen_pairs(self) -> list[tuple[float, int]]:
        """(logprob, token id) of each scored prompt position."""
        if not self.values:
            return []
        return list(zip(torch.cat(self.values).tolist(), torch.cat(self.ids).tolist()))

    def top_pairs(self) -> list[list[tuple[float, int]]]:
        """The (logprob, token id) pairs of the top tokens at each scored position."""
        if not self.top_values:
            return []
        values, ids = torch.cat(self.top_values).tolist(), torch.cat(self.top_ids).tolist()
        return [list(zip(v, i)) for v, i in zip(values, ids)]


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator
    arrival: float = field(default_factory=time.monotonic)
    scope: RequestScope = field(default_factory=RequestScope)
    # its images' placeholders in the prompt (engine/images.py): `input_ids` holds the model's
    # image token there, `all_ids` each image's pseudo id
    images: tuple[ImageSpan, ...] = ()

    output_ids: list[int] = field(default_factory=list)
    all_ids: list[int] = field(default_factory=list)  # input_ids + output_ids
    text: str = ""
    finish_reason: FinishReason | None = None
    stops: StopScanner | None = None  # the walk over `text` looking for params.stop (if any)
    stop_regexes: StopRegexes | None = None  # params.stop_regex (if any)

    # Memory state; see mem_cache/slot_manager.py for who owns which part of the row.
    row: int | None = None
    kv_len: int = 0  # tokens of all_ids whose K/V are in the pool
    tree_len: int = 0  # row[:tree_len] belongs to the tree, locked through last_node
    last_node: TreeNode | None = None
    state_slot: int | None = None  # a recurrent model's state slot while it has a row
    snapshot_at: int = 0  # where its state is kept as a snapshot (slot_manager); 0: nowhere

    # Structured output: the constraint's CompileJob (structured/compiler.py) and the walk in it
    constraint: CompileJob | None = None
    guide: GrammarGuide | None = None

    # --is-embedding: how the prompt's hidden states pool, the sum of those pooled so far (mean
    # pooling) and how many positions it holds, and the reply's vector once the prompt is read
    pooling: Pooling | None = None
    pooled: torch.Tensor | None = None
    pooled_tokens: int = 0
    embedding: list[float] | None = None

    # Speculative decoding: the request's n-gram index and draft length (None when off)
    drafts: RequestDrafts | None = None

    # Accounting
    cached_tokens: int = 0  # prompt tokens not recomputed at first admission
    host_cached_tokens: int = 0  # of which loaded back from the host tier
    storage_cached_tokens: int = 0  # of which read from the disk tier
    admitted_at: float | None = None  # first admission to a batch: its queue time ends there
    weight_version: str = ""  # the weights every token was computed with (set at admission)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    forward_passes: int = 0  # forwards this request took part in (prefill chunks and decode steps)
    prompt_logprobs: PromptLogprobs = field(default_factory=PromptLogprobs)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_ids = list(self.input_ids)
        for image in self.images:
            self.all_ids[image.start : image.start + image.length] = [image.token] * image.length

    def image_tokens(self, end: int) -> int:
        """The prompt's image placeholders before position `end`."""
        return sum(max(0, min(end, i.start + i.length) - i.start) for i in self.images)

    @property
    def cache_salt(self) -> str:
        return self.scope.salt

    @property
    def priority(self) -> int:
        return self.scope.priority

    @property
    def deadline(self) -> float | None:
        """The monotonic time at which the request ends with `timeout`, if it has one."""
        return None if self.scope.timeout is None else self.arrival + self.scope.timeout

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens_to_compute(self) -> int:
        return len(self.all_ids) - self.kv_len

    @property
    def input_token_logprobs(self) -> list[tuple[float | None, int]]:
        """SGLang's convention: one entry per prompt token from `logprob_start_len` on, the
        first with logprob None (its logits are not computed, and at position 0 nothing
        predicts it); the OpenAI `echo` shows the same list."""
        first = self._first_scored_token()
        return [*first, *self.prompt_logprobs.chosen_pairs()] if first else []

    @property
    def input_top_logprobs(self) -> list[list[tuple[float, int]] | None]:
        """The top tokens at each entry of `input_token_logprobs` (None at its first)."""
        first: list[list[tuple[float, int]] | None] = [None]
        return first + list(self.prompt_logprobs.top_pairs()) if self._first_scored_token() else []

    def _first_scored_token(self) -> list[tuple[float | None, int]]:
        """[(None, the token at `logprob_start_len`)], or [] when no prompt token is scored."""
        start = self.params.logprob_start_len
        if not self.wants_prompt_logprobs() or start >= len(self.input_ids):
            return []
        return [(None, self.input_ids[start])]

    def stop_holdback(self) -> int:
        """Characters at the end of the text that could still begin a stop string: a stream
        holds them back until they cannot."""
        return 0 if self.stops is None else self.stops.holdback

    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - len(self.output_ids), 0)

    def wants_prompt_logprobs(self) -> bool:
        return self.params.return_logprob and self.params.logprob_start_len >= 0

    def meta_info(self) -> dict[str, Any]:
        end = self.finish_time or time.monotonic()
        meta = {
            "id": self.rid,
            "prompt_tokens": len(self.input_ids),
            "cached_tokens": self.cached_tokens,
            "host_cached_tokens": self.host_cached_tokens,
            "storage_cached_tokens": self.storage_cached_tokens,
            "completion_tokens": len(self.output_ids),
            "finish_reason": self.finish_reason.to_dict() if self.finish_reason else None,
            "e2e_latency": end - self.arrival,
            "ttft": (self.first_token_time - self.arrival) if self.first_token_time else None,
            "num_preemptions": self.num_preemptions,
            "forward_passes": self.forward_passes,
            "spec_accepted_tokens": self.drafts.accepted if self.drafts else 0,
            "weight_version": self.weight_version,
        }
        if self.params.return_logprob:
            # prompt logprobs become Python pairs only here, for the reply
            meta["input_token_logprobs"] = self.input_token_logprobs
            meta["output_token_logprobs"] = self.output_token_logprobs
            if self.params.top_logprobs_num:
                meta["output_top_logprobs"] = self.output_top_logprobs
                if self.wants_prompt_logprobs():
                    meta["input_top_logprobs"] = self.input_top_logprobs
        return meta

    def result(self) -> dict[str, Any]:
        result = {
            "text": self.text,
            "output_ids": list(self.output_ids),
            "meta_info": self.meta_info(),
        }
        if self.embedding is not None:
            result["embedding"] = self.embedding
        return result

    def pool(self, hidden: torch.Tensor) -> None:
        """Take the final hidden states of the prompt positions this step computed (`hidden`,
        from `kv_len` on): mean pooling sums each position once (a recomputed one is not added
        again); the last position sets the reply's `embedding`."""
        assert self.pooling is not None, "only an --is-embedding request pools"
        end = self.kv_len + len(hidden)
        if self.pooling.mode == "mean":
            new = hidden[max(self.pooled_tokens - self.kv_len, 0) :].sum(0)
            self.pooled = new if self.pooled is None else self.pooled + new
            self.pooled_tokens = max(self.pooled_tokens, end)
        if end == len(self.input_ids):
            if self.pooling.mode == "last":
                self.embedding = self.pooling.finish(hidden[-1])
            else:
                assert self.pooled is not None, "a prompt has a position"
                self.embedding = self.pooling.finish(self.pooled / len(self.input_ids))


class Scheduled(NamedTuple):
    """One request's part of a step: its next n tokens (1 for a decode, a chunk for a prefill;
    for a decode with drafts, its last token then the `draft`, n = 1 + len(draft))."""

    req: Req
    n: int
    draft: tuple[int, ...] = ()

    def input_ids(self) -> list[int]:
        """The tokens this step computes K/V for."""
        start = self.req.kv_len
        return self.req.all_ids[start : start + self.n - len(self.draft)] + list(self.draft)
