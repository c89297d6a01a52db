"""The one interface the engine sees of a constraint, whichever backend compiled it.

A `Grammar` is a compiled constraint (shared by every request that asks for the same one, and
held in the compiler's cache); `Grammar.guide()` starts one request's walk through it, a
`GrammarGuide`. The scheduler, the sampler's masks, jump-forward, speculative verification and
tool calls use only these two. Backends:

- outlines-core (`guide.py`): a regex DFA (`Index`), built in killable worker processes;
- llguidance (`llguidance_backend.py`): Earley parsing over lexer DFAs, for context-free
  grammars (`ebnf`, `lark`) and JSON schemas with keywords outlines-core ignores (numeric bounds,
  `multipleOf`, ...) always, and, with `--grammar-backend llguidance`, for every kind.

Speculative drafts need no rollback here: `allowed_prefix` checks a draft without advancing,
and a walk advances only by tokens that verification accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

GRAMMAR_BACKENDS = ("outlines", "llguidance")
DEFAULT_GRAMMAR_BACKEND = "outlines"
# constraint kinds only a context-free backend takes: they always compile with llguidance
CFG_KINDS = ("ebnf", "lark")
# every kind a request may constrain its output with (at most one per request)
CONSTRAINT_KINDS = ("regex", "json_schema", "choices", "dtype", *CFG_KINDS)


class ConstraintError(ValueError):
    """A constraint that is malformed or too complex to compile; its request ends with
    `invalid_constraint`."""


class CompilerBusy(ConstraintError):
    """A constraint the compiler would not take or could not start in time: its tenant already
    has its cap of compiles in flight, or it waited past its budget for a worker. Its request
    ends with `overloaded`, and the verdict is not cached (a retry may compile)."""


class GrammarGuide(Protocol):
    """One request's position in a compiled constraint."""

    def advance(self, token_id: int) -> None:
        """Consume a sampled token (EOS included); ValueError if the constraint does not allow it."""

    def jump_forward(self, token_id: int) -> list[int]:
        """The tokens to append for a sampled `token_id`: itself, followed by the tokens the
        constraint then forces (jump-forward; none unless the guide was started with it), without
        a last token that a longer allowed one could extend. Does not advance."""

    def allowed_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order from the current position, the constraint allows
        (EOS counts where the output is complete). Does not advance."""

    def is_final(self) -> bool:
        """The output so far fully matches the constraint, so EOS is allowed."""

    def allowed_only_eos(self) -> bool:
        """The output is complete and nothing but EOS may follow."""

    def fill_mask(self, bitmask_row: torch.Tensor) -> None:
        """Write the allowed ids into one contiguous int32 CPU bitmask row (bit j of word i =
        token 32*i + j), overwritten entirely; the EOS bit is set exactly when the output is final."""


class Grammar(Protocol):
    """A compiled constraint; immutable, shared by the requests that walk it."""

    backend: str

    def guide(self, jump_forward: bool = False) -> GrammarGuide:
        """A new walk from the start; with `jump_forward`, one whose `jump_forward` appends
        forced text."""


def backend_for(kind: str, default: str) -> str:
    """The backend that compiles a constraint of `kind` when `default` is `--grammar-backend`:
    context-free kinds need llguidance, the rest follow the flag."""
    if default not in GRAMMAR_BACKENDS:
        raise ValueError(f"unknown grammar backend {default!r}; expected one of {GRAMMAR_BACKENDS}")
    return "llguidance" if kind in CFG_KINDS else default
