"""Structured generation on top of outlines-core: regex / JSON schema / choices / dtype -> token masks.

A constraint compiles to an `outlines_core.Index` (a DFA over token ids, shared and cached); each
request walks it with a `TokenGuide`, which writes the allowed ids of its state into one row of an
int32 bitmask (bit j of word i = token 32*i + j). `apply_bitmask` turns a batch of such rows into
-inf logits. Where the constraint leaves only one way on (`{"name": "` in a JSON object), jump-forward
decoding appends the forced text at once instead of decoding it token by token.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Any, Callable

import numpy as np
import torch
from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

JSON_WHITESPACE = ""  # compact, as json.dumps(separators=(",", ":")): short outputs, long forced runs
DTYPE_REGEXES = {
    "int": r"-?(0|[1-9][0-9]*)",
    "float": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    "bool": r"(true|false)",
    "str": r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"',
}
# Cheap up-front bounds on schema repetition counts (the automaton grows with them).
MAX_SCHEMA_LENGTH = 256
MAX_SCHEMA_ITEMS = 64
MAX_JUMP_BYTES = 512
_SCHEMA_KEYWORDS = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf")

_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_VOCAB_CACHE: dict[tuple, Vocabulary] = {}


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _token_decoder(tokenizer) -> Callable[[str], bytes]:
    """How a vocabulary token string turns into the bytes it stands for."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        kind = backend.decoder.__getstate__().decode()
    else:
        tokens = tokenizer.get_vocab()
        kind = "Metaspace" if any(t.startswith("▁") for t in tokens) else "ByteLevel" if "Ġ" in tokens else ""
    if "ByteLevel" in kind:
        table = _gpt2_unicode_to_byte()
        return lambda token: bytes(table[c] for c in token) if all(c in table for c in token) else token.encode()
    if "Metaspace" in kind or "ByteFallback" in kind or "▁" in kind:
        def sentencepiece(token: str) -> bytes:
            match = _SP_BYTE.fullmatch(token)
            return bytes([int(match.group(1), 16)]) if match else token.replace("▁", " ").encode()
        return sentencepiece
    return str.encode


def token_bytes(tokenizer) -> dict[int, bytes]:
    """id -> the bytes a token stands for, for every token but the special ones (EOS included);
    non-special added tokens count as their literal UTF-8 text."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    decode = _token_decoder(tokenizer)
    return {token_id: added[token_id].content.encode() if token_id in added else decode(token)
            for token, token_id in tokenizer.get_vocab().items() if token_id not in special}


def build_vocabulary(tokenizer, mapping: dict[int, bytes] | None = None) -> Vocabulary:
    """The tokenizer's vocabulary for outlines-core: `token_bytes` (or the `mapping` already made
    from it) grouped by bytes, EOS given separately. Cached per tokenizer."""
    key = (id(tokenizer), tokenizer.name_or_path, len(tokenizer))
    if key in _VOCAB_CACHE:
        return _VOCAB_CACHE[key]
    if tokenizer.eos_token_id is None:
        raise ValueError("constrained generation needs a tokenizer with an EOS token")
    by_bytes: dict[bytes, list[int]] = {}
    for token_id, data in (mapping or token_bytes(tokenizer)).items():
        if data:
            by_bytes.setdefault(data, []).append(token_id)
    vocabulary = Vocabulary(tokenizer.eos_token_id, by_bytes)
    _VOCAB_CACHE[key] = vocabulary
    return vocabulary


def _check_schema(node: Any, path: str = "$") -> None:
    """Reject up front, cheaply, schema shapes whose DFA is known to explode; the compile-time
    budget catches the rest (e.g. a top-level string with maxLength 20 already takes minutes)."""
    if not isinstance(node, dict):
        return
    if not any(k in node for k in _SCHEMA_KEYWORDS):
        raise ValueError(f"JSON schema at {path} accepts any JSON value, which is too complex to constrain; "
                         "give it a type")
    types = node["type"] if isinstance(node.get("type"), list) else [node.get("type")]
    if "object" in types and not node.get("properties") and not isinstance(node.get("additionalProperties"), dict):
        raise ValueError(f"JSON schema at {path} is a free-form object, which is too complex to constrain; "
                         "list its properties")
    if "array" in types and "items" not in node and "prefixItems" not in node:
        raise ValueError(f"JSON schema at {path} is an array of any values, which is too complex to constrain; "
                         "give its items")
    for bound, limit in (("minLength", MAX_SCHEMA_LENGTH), ("maxLength", MAX_SCHEMA_LENGTH),
                         ("minItems", MAX_SCHEMA_ITEMS), ("maxItems", MAX_SCHEMA_ITEMS)):
        if isinstance(node.get(bound), int) and node[bound] > limit:
            raise ValueError(f"JSON schema at {path}: {bound}={node[bound]} is too large to constrain "
                             f"(at most {limit}); the automaton grows with it")
    for key in ("properties", "$defs", "definitions"):
        for name, sub in (node.get(key) or {}).items():
            _check_schema(sub, f"{path}.{key}.{name}")
    for key in ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not"):
        subs = node.get(key)
        for i, sub in enumerate(subs if isinstance(subs, list) else [subs]):
            _check_schema(sub, f"{path}.{key}[{i}]" if isinstance(subs, list) else f"{path}.{key}")


class ConstraintCompiler:
    """Compiles constraints to outlines-core Indexes for one tokenizer, with an LRU cache and a time budget.

    Regexes use the Rust regex-automata dialect (no lookaround, no backreferences) and must match the
    whole output. JSON schemas go through outlines-core with a compact whitespace pattern.
    """

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 64, max_compile_s: float = 10.0,
                 whitespace_pattern: str = JSON_WHITESPACE):
        if len(tokenizer) > vocab_size:
            raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model only {vocab_size}")
        self.tokens = TokenTable(tokenizer, vocab_size)
        self.vocabulary = build_vocabulary(tokenizer, self.tokens.mapping)
        self.eos_token_id: int = self.vocabulary.get_eos_token_id()
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.max_compile_s = max_compile_s
        self.whitespace_pattern = whitespace_pattern
        # Builds finished or in flight, so concurrent requests for one constraint share one build.
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._forced: OrderedDict[int, ForcedStrings] = OrderedDict()  # by id(index); each holds its index
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="constraint-compile")

    def compile(self, regex: str | None = None, json_schema: str | dict | None = None,
                choices: list[str] | None = None, dtype: str | None = None) -> Index:
        """Compile exactly one of: a regex; a JSON schema (str or dict); a list of literal choices;
        or a dtype: "int" (JSON integer), "float" (JSON number), "bool" (true|false), "str" (a
        double-quoted JSON string). Raises ValueError for bad or too complex constraints."""
        given = {k: v for k, v in (("regex", regex), ("json_schema", json_schema), ("choices", choices),
                                    ("dtype", dtype)) if v is not None}
        if len(given) != 1:
            raise ValueError(f"give exactly one of regex, json_schema, choices, dtype (got {sorted(given)})")
        kind, value = given.popitem()
        if kind == "json_schema":
            source = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choices":
            if not value or not all(isinstance(c, str) for c in value):
                raise ValueError("choices must be a non-empty list of strings")
            source = json.dumps(value)
        else:
            source = value
        key = (kind, source)

        with self._lock:
            future = self._cache.get(key)
            if future is None:
                pattern = self._to_regex(kind, value, source)
                future = Future()
                threading.Thread(target=self._build, args=(future, kind, pattern), daemon=True).start()
                self._cache[key] = future
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        try:
            return future.result(timeout=self.max_compile_s)
        except FutureTimeout:
            # The build cannot be cancelled; remember the verdict so retries fail fast.
            error = ValueError(f"{kind} constraint is too complex: compiling took over {self.max_compile_s:g}s")
            rejected = Future()
            rejected.set_exception(error)
            with self._lock:
                if self._cache.get(key) is future:
                    self._cache[key] = rejected
            raise error from None

    def compile_async(self, regex: str | None = None, json_schema: str | dict | None = None,
                      choices: list[str] | None = None, dtype: str | None = None) -> Future:
        """`compile` off the caller's thread; the Future holds the Index or the ValueError."""
        return self._executor.submit(self.compile, regex=regex, json_schema=json_schema, choices=choices,
                                     dtype=dtype)

    def guide(self, index: Index, jump_forward: bool = False) -> "TokenGuide":
        """A new walk through `index`; with `jump_forward`, one that can append forced text at once."""
        forced = None
        if jump_forward:
            with self._lock:
                forced = self._forced.pop(id(index), None) or ForcedStrings(index, self.tokens)
                self._forced[id(index)] = forced
                while len(self._forced) > self.cache_size:
                    self._forced.popitem(last=False)
        return TokenGuide(index, self.eos_token_id, forced)

    def _to_regex(self, kind: str, value: Any, source: str) -> str:
        if kind == "regex":
            return value
        if kind == "choices":
            return "(" + "|".join(re.escape(c) for c in value) + ")"
        if kind == "dtype":
            if value not in DTYPE_REGEXES:
                raise ValueError(f"unknown dtype {value!r}; expected one of {sorted(DTYPE_REGEXES)}")
            return DTYPE_REGEXES[value]
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        _check_schema(schema)
        try:
            return build_regex_from_schema(source, self.whitespace_pattern)
        except (ValueError, TypeError) as e:
            raise ValueError(f"unsupported JSON schema: {e}") from None

    def _build(self, future: Future, kind: str, pattern: str) -> None:
        try:
            if kind == "regex":
                _check_regex_syntax(pattern)
            # outlines-core 0.2.x drops every token edge from an accepting state into a non-accepting
            # one (regex-automata reports matches one byte late), so `1(\.5)?` could never reach
            # "1.5". Anchoring at end of input makes no state before the end a match state.
            future.set_result(Index(f"(?:{pattern})\\z", self.vocabulary))
        except ValueError as e:
            future.set_exception(ValueError(f"cannot compile {kind} constraint {pattern[:200]!r}: {e}"))
        except BaseException as e:  # anything else must still reach the waiter
            future.set_exception(e)


_PROBE_VOCABULARY = Vocabulary(1, {b"\x00": [0]})


def _check_regex_syntax(regex: str) -> None:
    """Parse the regex alone (an unbalanced one could turn valid once wrapped) against a one-token
    vocabulary: a syntax error fails to build the DFA, anything else only mismatches the vocabulary."""
    try:
        Index(regex, _PROBE_VOCABULARY)
    except ValueError as e:
        if "DFA" in str(e):
            raise ValueError(f"invalid regex (Rust regex-automata syntax: no lookaround or backreferences): {e}") \
                from None


class TokenTable:
    """What jump-forward needs to know of a tokenizer's tokens, as bytes."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.mapping = token_bytes(tokenizer)
        self.bytes_of = [self.mapping.get(i, b"") for i in range(vocab_size)]
        self.first_byte = np.array([data[0] if data else -1 for data in self.bytes_of], dtype=np.int16)
        self.lengths = np.array([len(data) for data in self.bytes_of], dtype=np.int32)
        self.byte_token = {data[0]: i for i, data in self.mapping.items() if len(data) == 1}

    def encode(self, data: bytes) -> list[int] | None:
        """The tokenizer's own ids for `data`, or None when they would not spell exactly these bytes."""
        try:
            text = data.decode()
        except UnicodeDecodeError:
            return None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids if b"".join(self.bytes_of[i] for i in ids) == data else None


class ForcedStrings:
    """For one Index, per state: the bytes every continuation must start with, and the state after
    them. They stop at a final state (EOS could come instead) and at a whole UTF-8 character."""

    def __init__(self, index: Index, tokens: TokenTable):
        self.index = index
        self.tokens = tokens
        self._cache: dict[int, tuple[bytes, int]] = {}

    def allowed(self, state: int) -> np.ndarray:
        return np.asarray(self.index.get_allowed_tokens(state), dtype=np.int64)

    def after(self, state: int) -> tuple[bytes, int]:
        if state not in self._cache:
            self._cache[state] = self._walk(state)
        return self._cache[state]

    def _walk(self, state: int) -> tuple[bytes, int]:
        forced, states = bytearray(), [state]
        while len(forced) < MAX_JUMP_BYTES and not self.index.is_final_state(states[-1]):
            firsts = np.unique(self.tokens.first_byte[self.allowed(states[-1])])
            if len(firsts) != 1 or firsts[0] < 0 or int(firsts[0]) not in self.tokens.byte_token:
                break
            nxt = self.index.get_next_state(states[-1], self.tokens.byte_token[int(firsts[0])])
            if nxt is None:
                break
            forced.append(int(firsts[0]))
            states.append(nxt)
        while forced:  # never end inside a character: the text is re-tokenized
            try:
                forced.decode()
                break
            except UnicodeDecodeError:
                forced.pop()
                states.pop()
        return bytes(forced), states[-1]

    def extendable(self, state: int, token_id: int) -> bool:
        """Whether a longer token than `token_id`, spelling its bytes first, is allowed in `state`."""
        data = self.tokens.bytes_of[token_id]
        ids = self.allowed(state)
        longer = ids[(self.tokens.lengths[ids] > len(data)) & (self.tokens.first_byte[ids] == data[0])]
        return any(self.tokens.bytes_of[i].startswith(data) for i in longer.tolist())


class TokenGuide:
    """One request's position in a constraint's DFA."""

    def __init__(self, index: Index, eos_token_id: int, forced: ForcedStrings | None = None):
        self.index = index
        self.eos_token_id = eos_token_id
        self.forced = forced
        self.guide = Guide(index, max_rollback=0)
        self.finished = False  # EOS was accepted
        self._only_eos: dict[int, bool] = {}

    def advance(self, token_id: int) -> None:
        """Consume a sampled token; raises ValueError if the constraint does not allow it."""
        if self.finished:
            raise ValueError("constraint already ended with EOS")
        if token_id == self.eos_token_id:
            # outlines-core has no transition for EOS (Guide.advance raises); it just ends the walk.
            if not self.guide.is_finished():
                raise ValueError("EOS is not allowed before the constraint is satisfied")
            self.finished = True
            return
        self.guide.advance(token_id, return_tokens=False)

    def jump_forward(self, token_id: int) -> list[int]:
        """The tokens to append for a sampled `token_id`: itself, or, when the constraint then forces
        a string, the tokenizer's own tokens for both (the boundary re-tokenized), without a last
        token that an allowed longer token could extend (the model picks that one). Does not advance."""
        if self.forced is None or token_id == self.eos_token_id:
            return [token_id]
        state = self.guide.get_state()
        after = self.index.get_next_state(state, token_id)
        forced = self.forced.after(after)[0] if after is not None else b""
        if not forced:
            return [token_id]
        ids = self.forced.tokens.encode(self.forced.tokens.bytes_of[token_id] + forced)
        states = [state]
        for token in ids or []:
            states.append(self.index.get_next_state(states[-1], token))
            if states[-1] is None:
                return [token_id]
        if not ids:
            return [token_id]
        if len(ids) > 1 and self.forced.extendable(states[-2], ids[-1]):
            ids.pop()
        return ids

    def is_final(self) -> bool:
        """The output so far fully matches the constraint, so EOS is allowed."""
        return self.guide.is_finished()

    def allowed_only_eos(self) -> bool:
        """The output is complete and nothing but EOS may follow."""
        if self.finished:
            return True
        if not self.guide.is_finished():
            return False
        state = self.guide.get_state()
        if state not in self._only_eos:
            self._only_eos[state] = len(self.index.get_allowed_tokens(state)) == 1
        return self._only_eos[state]

    def fill_mask(self, bitmask_row: torch.Tensor) -> None:
        """Write the allowed ids of the current state into one contiguous int32 CPU bitmask row
        (overwritten entirely; the EOS bit is set exactly when the output is final)."""
        assert bitmask_row.dtype == torch.int32 and bitmask_row.is_contiguous() and bitmask_row.device.type == "cpu"
        self.guide.write_mask_into(bitmask_row.data_ptr(), bitmask_row.numel(), 4)


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A zeroed (nothing allowed) int32 CPU bitmask of shape [batch, ceil(vocab_size / 32)]."""
    return torch.zeros(batch, (vocab_size + 31) // 32, dtype=torch.int32)


_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """In place, set logits[r, t] = -inf where bit t of bitmask[r] is 0, for r in `rows` (every row
    if None). Bitmask rows line up with logits rows; logits columns beyond the bitmask are masked too."""
    if rows is not None and not rows:
        return
    device = logits.device
    if device not in _BIT_VALUES:
        # 1 << 31 as int32 is the sign bit: exactly the bit pattern wanted.
        _BIT_VALUES[device] = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32,
                                           device=device)
    if rows is not None:
        bitmask = bitmask[rows]
    words = bitmask.to(device)
    vocab = logits.shape[1]
    covered = min(vocab, 32 * words.shape[1])
    disallowed = (words.unsqueeze(-1) & _BIT_VALUES[device]).eq(0).view(words.shape[0], -1)[:, :covered]
    if rows is None:
        target = logits
    else:
        index = torch.tensor(rows, device=device)
        target = logits.index_select(0, index)
    target[:, :covered].masked_fill_(disallowed, float("-inf"))
    if covered < vocab:
        target[:, covered:] = float("-inf")
    if rows is not None:
        logits.index_copy_(0, index, target)
