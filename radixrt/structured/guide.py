"""The outlines-core backend of `grammar.Grammar`: a compiled regex DFA (`OutlinesGrammar`) and
one request's walk through it (`TokenGuide`): advance by sampled tokens, write the allowed ids
into its bitmask row, and (with jump-forward) say which tokens a sampled one brings along."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from outlines_core import Guide, Index

from radixrt.structured.jump_forward import ForcedStrings
from radixrt.structured.vocabulary import TokenTable


@dataclass(eq=False)
class OutlinesGrammar:
    """An outlines-core Index with what its walks share: the token table and, made on the first
    jump-forward walk, the forced strings of its states (a per-state cache)."""

    index: Index
    tokens: TokenTable
    eos_token_id: int
    backend: str = "outlines"
    _forced: ForcedStrings | None = field(default=None, repr=False)

    def guide(self, jump_forward: bool = False) -> TokenGuide:
        if jump_forward and self._forced is None:
            self._forced = ForcedStrings(self.index, self.tokens)
        return TokenGuide(self.index, self.eos_token_id, self._forced if jump_forward else None)


class TokenGuide:
    """One request's position in a constraint's DFA (a `grammar.GrammarGuide`)."""

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

    def allowed_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order from the current state, the constraint allows
        (speculative drafts are cut there before they cost a forward). Does not advance."""
        if self.finished:
            return 0
        state = self.guide.get_state()
        for i, token_id in enumerate(token_ids):
            if token_id == self.eos_token_id:
                return i + bool(self.index.is_final_state(state))
            state = self.index.get_next_state(state, token_id)
            if state is None:
                return i
        return len(token_ids)

    def is_final(self) -> bool:
        """The output so far fully matches the constraint, so EOS is allowed."""
        return bool(self.guide.is_finished())

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
        assert (
            bitmask_row.dtype == torch.int32
            and bitmask_row.is_contiguous()
            and bitmask_row.device.type == "cpu"
        )
        self.guide.write_mask_into(bitmask_row.data_ptr(), bitmask_row.numel(), 4)
