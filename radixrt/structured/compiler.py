"""Constraints (regex, JSON schema, choices, dtype) compiled to outlines-core Indexes: checked up
front, built off the caller's thread under a time budget, cached (LRU) and shared by concurrent
requests for the same constraint."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from outlines_core import Index, Vocabulary

from radixrt.structured.guide import TokenGuide
from radixrt.structured.jump_forward import ForcedStrings
from radixrt.structured.regexes import DTYPE_REGEXES, JSON_WHITESPACE, schema_regex
from radixrt.structured.vocabulary import TokenTable, build_vocabulary


class ConstraintCompiler:
    """Compiles constraints to outlines-core Indexes for one tokenizer, with an LRU cache and a time budget.

    Regexes use the Rust regex-automata dialect (no lookaround, no backreferences) and must match the
    whole output. JSON schemas go through outlines-core with a compact whitespace pattern.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        cache_size: int = 64,
        max_compile_s: float = 10.0,
        whitespace_pattern: str = JSON_WHITESPACE,
    ):
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens but the model only {vocab_size}"
            )
        self.tokens = TokenTable(tokenizer, vocab_size)
        self.vocabulary = build_vocabulary(tokenizer, self.tokens.mapping)
        self.eos_token_id: int = self.vocabulary.get_eos_token_id()
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.max_compile_s = max_compile_s
        self.whitespace_pattern = whitespace_pattern
        # Builds finished or in flight, so concurrent requests for one constraint share one build.
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        # by id(index); each holds its index
        self._forced: OrderedDict[int, ForcedStrings] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="constraint-compile")

    def compile(
        self,
        regex: str | None = None,
        json_schema: str | dict | None = None,
        choices: list[str] | None = None,
        dtype: str | None = None,
    ) -> Index:
        """Compile exactly one of: a regex; a JSON schema (str or dict); a list of literal choices;
        or a dtype: "int" (JSON integer), "float" (JSON number), "bool" (true|false), "str" (a
        double-quoted JSON string). Raises ValueError for bad or too complex constraints."""
        given = {
            k: v
            for k, v in (
                ("regex", regex),
                ("json_schema", json_schema),
                ("choices", choices),
                ("dtype", dtype),
            )
            if v is not None
        }
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of regex, json_schema, choices, dtype (got {sorted(given)})"
            )
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
                threading.Thread(
                    target=self._build, args=(future, kind, pattern), daemon=True
                ).start()
                self._cache[key] = future
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        try:
            return future.result(timeout=self.max_compile_s)
        except FutureTimeout:
            # The build cannot be cancelled; remember the verdict so retries fail fast.
            error = ValueError(
                f"{kind} constraint is too complex: compiling took over {self.max_compile_s:g}s"
            )
            rejected = Future()
            rejected.set_exception(error)
            with self._lock:
                if self._cache.get(key) is future:
                    self._cache[key] = rejected
            raise error from None

    def compile_async(
        self,
        regex: str | None = None,
        json_schema: str | dict | None = None,
        choices: list[str] | None = None,
        dtype: str | None = None,
    ) -> Future:
        """`compile` off the caller's thread; the Future holds the Index or the ValueError."""
        return self._executor.submit(
            self.compile, regex=regex, json_schema=json_schema, choices=choices, dtype=dtype
        )

    def guide(self, index: Index, jump_forward: bool = False) -> TokenGuide:
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
                raise ValueError(
                    f"unknown dtype {value!r}; expected one of {sorted(DTYPE_REGEXES)}"
                )
            return DTYPE_REGEXES[value]
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        return schema_regex(schema, self.whitespace_pattern)

    def _build(self, future: Future, kind: str, pattern: str) -> None:
        try:
            if kind == "regex":
                _check_regex_syntax(pattern)
            # outlines-core 0.2.x drops every token edge from an accepting state into a non-accepting
            # one (regex-automata reports matches one byte late), so `1(\.5)?` could never reach
            # "1.5". Anchoring at end of input makes no state before the end a match state.
            future.set_result(Index(f"(?:{pattern})\\z", self.vocabulary))
        except ValueError as e:
            future.set_exception(
                ValueError(f"cannot compile {kind} constraint {pattern[:200]!r}: {e}")
            )
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
            raise ValueError(
                f"invalid regex (Rust regex-automata syntax: no lookaround or backreferences): {e}"
            ) from None
