"""The stateful mixers' kernels on their own: the gated delta rule a chunk at a time (the
prefill's `delta_chunk`) equals its token-by-token recurrence (the decode's `_step`), from a
state carried in and to the state carried out, on random inputs in the ranges the model feeds
it (L2-normed q and k, decays below 1, write strengths in (0, 1))."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixrt.models.layers import DELTA_CHUNK, GatedDeltaNet, delta_chunk


@pytest.mark.parametrize("tokens", [1, 7, DELTA_CHUNK])
def test_a_chunk_of_the_delta_rule_equals_its_recurrence(tokens):
    torch.manual_seed(tokens)
    heads, dk, dv = 4, 16, 8
    s0 = torch.randn(heads, dk, dv)
    q = F.normalize(torch.randn(tokens, heads, dk), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(tokens, heads, dk), dim=-1)
    v = torch.randn(tokens, heads, dv)
    g = -2 * torch.rand(tokens, heads)
    beta = torch.rand(tokens, heads)
    state = s0.clone()[None]
    steps = [
        GatedDeltaNet._step(state, *(x[t : t + 1] for x in (q, k, v, g, beta)))
        for t in range(tokens)
    ]
    out, after = delta_chunk(s0, q, k, v, g, beta)
    torch.testing.assert_close(out, torch.cat(steps), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(after, state[0], atol=2e-6, rtol=1e-5)
