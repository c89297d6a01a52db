"""The stateful mixers' kernels on their own: the gated delta rule a chunk at a time (the
prefill's `delta_chunk`) equals its token-by-token recurrence (the decode's `_step`), from a
state carried in and to the state carried out, on random inputs in the ranges the model feeds
it (L2-normed q and k, decays below 1, write strengths in (0, 1)); and so Mamba-2's scan in
the SSD form (`ssd_chunk`) against its recurrence (`Mamba2Mixer._step`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixrt.models.layers import DELTA_CHUNK, GatedDeltaNet, Mamba2Mixer, delta_chunk, ssd_chunk


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


@pytest.mark.parametrize("tokens", [1, 7, 32])
def test_a_chunk_of_the_mamba2_scan_equals_its_recurrence(tokens):
    """`ssd_chunk` against `Mamba2Mixer._step` token by token: 4 heads of 8 over a state of 16,
    time steps and decays in the model's ranges (dt > 0, a < 0), some decaying to near 0."""
    torch.manual_seed(tokens)
    heads, head_dim, state = 4, 8, 16
    s0 = torch.randn(heads, head_dim, state)
    x = torch.randn(tokens, heads, head_dim)
    dt = F.softplus(torch.randn(tokens, heads))
    a = -torch.tensor([0.1, 1.0, 4.0, 16.0])
    b, c = torch.randn(tokens, heads, state), torch.randn(tokens, heads, state)
    carried = s0.clone()[None]
    steps = [
        Mamba2Mixer._step(carried, *(y[t : t + 1] for y in (x, dt)), a, b[t : t + 1], c[t : t + 1])
        for t in range(tokens)
    ]
    out, after = ssd_chunk(s0, x, dt, a, b, c)
    torch.testing.assert_close(out, torch.cat(steps), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, carried[0], atol=1e-5, rtol=1e-5)
