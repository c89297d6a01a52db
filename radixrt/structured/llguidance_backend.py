"""The llguidance backend of `grammar.Grammar`: context-free grammars (GBNF, Lark), and regexes,
JSON schemas, choices and dtypes when `--grammar-backend llguidance`.

A constraint becomes llguidance's grammar text (`grammar_text`), then an `LLMatcher` (`build`:
the lexer is built over the vocabulary, milliseconds, the GIL released), kept as the template
every request's walk deep-copies; the compiler runs both on its llguidance thread
(`translate_and_build`), never on the serving loop. A build cannot be killed from outside, but
it stops itself: LIMITS, set explicitly here rather than left to llguidance's defaults, cap the
lexer's fuel and states and the grammar's size (an overrun is an error, not a hang), and every
later mask step has its own fuel and item cap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark

from radixrt.structured.grammar import ConstraintError
from radixrt.structured.regexes import (
    MAX_REGEX_CHARS,
    check_enforced,
    closed_objects,
    load_schema,
    schema_nodes,
)

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase

MAX_GRAMMAR_CHARS = MAX_REGEX_CHARS
# compact JSON, as the outlines backend's JSON_WHITESPACE: short outputs, long forced runs
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# Each bound a build and a mask step obey (llguidance 1.9's defaults, made explicit so an upgrade
# cannot loosen them): the Earley items of one row and of one step, the lexer's fuel to build
# (initial) and per step, its DFA states, and the grammar's size in symbols.
LIMITS = LLParserLimits(
    max_items_in_row=2_000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=250_000,
    max_grammar_size=500_000,
    verbose_errors=False,  # errors name the fault, not the parser's state
)


def tokenizer(hf_tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> LLTokenizer:
    """llguidance's view of a (fast) HF tokenizer, with the model's vocabulary size so masks
    line up with the logits; about a second, so the compiler makes it once. ValueError for a
    slow (Python) tokenizer, which llguidance cannot read."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(hf_tokenizer, PreTrainedTokenizerFast):
        raise ValueError("the llguidance grammar backend needs a fast (Rust) tokenizer")
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


def grammar_text(kind: str, value: Any) -> str:
    """The llguidance grammar of a constraint (`regex` stands for choices and dtypes too, as
    their regexes); ConstraintError for a value of the wrong type, too long, or (GBNF) one that
    does not convert. Grammar errors proper surface in `build`."""
    if kind == "json_schema":
        try:
            schema = closed_objects(load_schema(value))
            for path, node in schema_nodes(schema):
                check_enforced(node, path)
            text = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ConstraintError(str(e)) from None
        check_implemented(text)
        return text
    if not isinstance(value, str):
        raise ConstraintError(f"{kind} must be a string")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(f"{kind} has {len(value)} chars; at most {MAX_GRAMMAR_CHARS}")
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "ebnf":
        try:
            value = gbnf_to_lark(value)
        except Exception as e:  # noqa: BLE001 (the converter raises several types)
            raise ConstraintError(f"invalid ebnf (GBNF) grammar: {e}") from None
    text = LLMatcher.grammar_from_lark(value)
    check_implemented(text)
    return text


def check_implemented(text: str) -> None:
    """ConstraintError naming what llguidance would ignore in a grammar (JSON-schema keys it does
    not implement, unknown string formats, also inside a Lark grammar's `%json`): ignored, they
    could be broken by outputs said to validate."""
    _, warnings = LLMatcher.validate_grammar_with_warnings(text)
    ignored = [w for w in warnings if w.startswith(("Unimplemented keys", "Unknown format"))]
    if ignored:
        raise ConstraintError(f"constraint cannot be enforced while decoding: {'; '.join(ignored)}")


def translate_and_build(
    tokens: LLTokenizer, kind: str, value: Any, eos_token_id: int
) -> LLGuidanceGrammar:
    """`build` of `grammar_text(kind, value)`: the whole cost of a constraint, for the compiler's
    thread; ConstraintError as either raises it."""
    return build(tokens, kind, grammar_text(kind, value), eos_token_id)


def build(tokens: LLTokenizer, kind: str, text: str, eos_token_id: int) -> LLGuidanceGrammar:
    """The compiled grammar of `text` (from `grammar_text`); ConstraintError with llguidance's
    message when it does not compile or overruns LIMITS."""
    matcher = LLMatcher(tokens, text, log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise ConstraintError(f"cannot compile {kind} constraint: {matcher.get_error()}")
    return LLGuidanceGrammar(matcher, eos_token_id)


class LLGuidanceGrammar:
    """A compiled llguidance grammar: a matcher at the start, copied for each walk."""

    backend = "llguidance"

    def __init__(self, template: LLMatcher, eos_token_id: int):
        self.template = template
        self.eos_token_id = eos_token_id

    def guide(self, jump_forward: bool = False) -> LLGuidanceGuide:
        return LLGuidanceGuide(self.template.deep_copy(), self.eos_token_id, jump_forward)


class LLGuidanceGuide:
    """One request's walk through an llguidance grammar (a `grammar.GrammarGuide`). The matcher
    enters an error state for good on a disallowed token, so nothing unchecked is consumed."""

    def __init__(self, matcher: LLMatcher, eos_token_id: int, jump_forward: bool):
        self.matcher = matcher
        self.eos_token_id = eos_token_id
        self.forced = jump_forward
        self.finished = False  # EOS was accepted

    def advance(self, token_id: int) -> None:
        if self.finished:
            raise ValueError("constraint already ended with EOS")
        if token_id == self.eos_token_id:
            # as in outlines-core, EOS just ends the walk (a stopped matcher takes no EOS)
            if not self.matcher.is_accepting():
                raise ValueError("EOS is not allowed before the constraint is satisfied")
            self.finished = True
            return
        if self.matcher.validate_tokens([token_id]) != 1:
            raise ValueError(f"the constraint does not allow token {token_id} here")
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"constraint error: {self.matcher.get_error()}")

    def jump_forward(self, token_id: int) -> list[int]:
        """llguidance's fast-forward tokens after `token_id` (it leaves out a last token a longer
        one could extend, and re-tokenizes canonically); consumed and rolled back."""
        if (
            not self.forced
            or token_id == self.eos_token_id
            or self.matcher.validate_tokens([token_id]) != 1
            or not self.matcher.consume_token(token_id)
        ):
            return [token_id]
        forced = self.matcher.compute_ff_tokens()
        self.matcher.rollback(1)
        return [token_id, *forced]

    def allowed_prefix(self, token_ids: list[int]) -> int:
        if self.finished:
            return 0
        n = int(self.matcher.validate_tokens(token_ids))
        if n < len(token_ids) and token_ids[n] == self.eos_token_id:
            n += self._accepting_after(token_ids[:n])
        return n

    def _accepting_after(self, token_ids: list[int]) -> bool:
        """Whether the output is complete after `token_ids` (all allowed): consumed, read,
        rolled back. llguidance's own check refuses EOS once its matcher has stopped."""
        if not self.matcher.consume_tokens(token_ids):
            raise ValueError(f"constraint error: {self.matcher.get_error()}")
        accepting = bool(self.matcher.is_accepting())
        self.matcher.rollback(len(token_ids))
        return accepting

    def is_final(self) -> bool:
        return bool(self.matcher.is_accepting())

    def allowed_only_eos(self) -> bool:
        return self.finished or bool(self.matcher.is_stopped())

    def fill_mask(self, bitmask_row: torch.Tensor) -> None:
        assert (
            bitmask_row.dtype == torch.int32
            and bitmask_row.is_contiguous()
            and bitmask_row.device.type == "cpu"
        )
        self.matcher.unsafe_compute_mask_ptr(bitmask_row.data_ptr(), bitmask_row.numel() * 4)
