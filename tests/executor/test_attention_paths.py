"""Which attention path a step takes, on the real (tiny) model: the torch backend's cascade decode
(a shared prefix read once for the whole batch, merged with each private suffix by log-sum-exp)
runs when decodes share cached pages, and still gives transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from radixrt.attention import torch_backend
from radixrt.attention.torch_backend import MIN_SHARED_PREFIX, TorchAttentionBackend
from radixrt.kernels import cpu_paged
from radixrt.sampling_params import SamplingParams

from helpers import hf_greedy, make_scheduler
from ownership import assert_slot_ownership

MAX_NEW = 8
MAX_STEPS = 200


def _prompts() -> list[list[int]]:
    """A 42-token prefix shared by four prompts, with private tails of different lengths."""
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(2000, 40000, (42,), generator=gen).tolist()
    return [shared + torch.randint(2000, 40000, (n,), generator=gen).tolist() for n in (1, 3, 6, 2)]


def _shared_len(shared_slots) -> int:
    if shared_slots is None:
        return 0
    if isinstance(shared_slots, slice):
        return shared_slots.stop - shared_slots.start
    return len(shared_slots)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gathered"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_cascade_decode_runs_and_matches_transformers(
    tiny_model_dir, monkeypatch, page_size, in_place
):
    """Decode steps over requests that share a cached 42-token prefix take the cascade path (the
    prefix is attended once, the log-sum-exp merge runs) and the outputs equal transformers',
    whether the private suffixes are read in place in the pool or gathered out of it."""
    decode_steps = []  # (decodes in the step, shared prefix length) of every step with decodes
    init = TorchAttentionBackend.init_forward_metadata

    def recording_init(self, batch):
        init(self, batch)
        meta = batch.attn_metadata[None]
        if len(meta.decode_tokens):
            decode_steps.append((len(meta.decode_tokens), _shared_len(meta.shared_slots)))

    attend_calls = []
    attend = torch_backend._attend

    def counting_attend(*args, **kwargs):
        attend_calls.append(args[1].shape)
        return attend(*args, **kwargs)

    paged_calls = []
    paged = cpu_paged.paged_decode

    def counting_paged(*args, **kwargs):
        paged_calls.append(args[0].shape)
        return paged(*args, **kwargs)

    monkeypatch.setattr(TorchAttentionBackend, "init_forward_metadata", recording_init)
    monkeypatch.setattr(torch_backend, "_attend", counting_attend)
    monkeypatch.setattr(cpu_paged, "paged_decode", counting_paged)

    scheduler = make_scheduler(tiny_model_dir, page_size=page_size)
    backend = scheduler.runner.attn_backend
    assert isinstance(backend, TorchAttentionBackend)
    if not in_place:
        backend.in_place = False
    assert backend.in_place == in_place, "the in-place decode kernel is not available here"
    prompts = _prompts()
    params = SamplingParams.from_dict(
        {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    )
    reqs = [scheduler.make_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for req in reqs:
        scheduler.add_request(req)
    for _ in range(MAX_STEPS):
        if not scheduler.has_work():
            break
        scheduler.step()
        scheduler.check_invariants()
    assert not scheduler.has_work()

    assert [r.output_ids for r in reqs] == hf_greedy(tiny_model_dir, prompts, MAX_NEW)
    whole_pages = 42 - 42 % page_size
    cascade = [(b, n) for b, n in decode_steps if n]
    assert cascade, f"no decode step took the cascade path: {decode_steps}"
    assert max(n for _, n in cascade) >= whole_pages >= MIN_SHARED_PREFIX
    assert any(b == len(prompts) for b, _ in cascade), (
        "the full batch never decoded over the shared prefix"
    )
    layers = scheduler.runner.config.num_hidden_layers
    # per layer of a cascade step: the prefix once, the private suffixes once (in the pool or
    # gathered); in place, every decode step reads its suffixes with the kernel
    if in_place:
        assert len(attend_calls) == layers * len(cascade), (
            "the prefix was not attended once a layer"
        )
        assert len(paged_calls) == layers * len(decode_steps), "a decode step gathered its K/V"
    else:
        assert len(attend_calls) == 2 * layers * len(cascade), (
            "the prefix/suffix merge did not run once per layer"
        )
        assert not paged_calls

    assert_slot_ownership(scheduler.memory_snapshot())
    assert scheduler.flush_cache()
    stats = scheduler.stats()
    assert stats["free_tokens"] == stats["total_tokens"]
