"""Jump-forward decoding: where a constraint leaves only one way on (`{"name": "` in a JSON object),
the forced text is appended at once instead of decoded token by token."""

from __future__ import annotations

import numpy as np
from outlines_core import Index

from radixrt.structured.vocabulary import TokenTable

MAX_JUMP_BYTES = 512


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
        longer = ids[
            (self.tokens.lengths[ids] > len(data)) & (self.tokens.first_byte[ids] == data[0])
        ]
        return any(self.tokens.bytes_of[i].startswith(data) for i in longer.tolist())
