"""The token arithmetic of admission: how many prompt tokens a step computes, how a long prompt
is chunked, and how much room the running batch is expected to still need."""

from __future__ import annotations

from dataclasses import dataclass

INIT_NEW_TOKEN_RATIO = 0.7  # share of a running request's remaining max_new_tokens reserved for it
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002  # per step, while nothing is retracted


@dataclass
class AdmissionBudget:
    """Most requests stop well before max_new_tokens, so reserving all of it would admit too few;
    reserving none would retract too often. The reserved share (`new_token_ratio`) starts at
    0.7, decays by 0.002 a step while nothing is retracted, and jumps back after a retraction."""

    chunked_prefill_size: int  # <= 0: no chunking
    max_prefill_tokens: int
    new_token_ratio: float = INIT_NEW_TOKEN_RATIO

    def step_tokens(self) -> int:
        """Prompt tokens one step may compute over all requests. With chunking on it is bounded
        by the chunk size too, so decodes never wait on a long prefill."""
        if self.chunked_prefill_size > 0:
            return min(self.max_prefill_tokens, self.chunked_prefill_size)
        return self.max_prefill_tokens

    def chunk(self, need: int, left: int) -> int:
        """Tokens of a prompt that still needs `need` to compute this step, with `left` prompt
        tokens left in the step; 0: none this step (without chunking a prompt runs whole or not)."""
        if self.chunked_prefill_size > 0:
            return min(need, self.chunked_prefill_size, left)
        return need if need <= left else 0

    def expected(self, uncomputed: int, remaining_new_tokens: int) -> float:
        """Slots a request is expected to still take after this step."""
        return uncomputed + remaining_new_tokens * self.new_token_ratio

    def decay(self) -> None:
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )

    def reset(self) -> None:
        """After a retraction: the reservations were too small."""
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
