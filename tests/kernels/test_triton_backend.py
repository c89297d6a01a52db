"""The runtime on the Triton backend (interpreted on CPU) gives the torch backend's greedy tokens."""

import pytest
from helpers import run_in_process

from radixrt.attention.triton_backend import TritonAttentionBackend
from radixrt.config import ServerArgs
from radixrt.scheduler import Scheduler

SAMPLING = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
SHARED = list(range(300, 311))
# Different lengths over one shared prefix, so chunked prefills overlap other requests' decodes.
PROMPTS = [SHARED + [501, 502, 503], SHARED + [601], SHARED[:3], SHARED + [701, 702, 703, 704, 705, 706]]
# Warm passes: the same prompts (fully cached), then each with new tokens after its cached part.
PASSES = [PROMPTS, PROMPTS, [p + [800 + i, 900 + i] for i, p in enumerate(PROMPTS)]]
CONFIGS = {"whole": {}, "chunked": {"chunked_prefill_size": 4}}


def _run(model_dir, backend: str, **args) -> list[list[int]]:
    """Greedy tokens of every pass, cold then prefix-cached, and the pool's bookkeeping after.

    The scheduler runs in this process (not behind `rt.Engine`) so the test can watch its steps."""
    scheduler = Scheduler(ServerArgs(model=str(model_dir), attention_backend=backend, max_total_tokens=512,
                                     **args))
    outs = run_in_process(scheduler, PASSES, SAMPLING)
    scheduler.check_invariants()
    assert scheduler.flush_cache()
    stats = scheduler.stats()
    assert stats["free_tokens"] == stats["total_tokens"]
    return outs


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_triton_backend_matches_torch(tiny_model_dir, monkeypatch, config):
    steps = []
    init = TritonAttentionBackend.init_forward_metadata

    def recording_init(self, batch):
        steps.append((list(batch.prefix_lens), list(batch.extend_lens)))
        init(self, batch)

    monkeypatch.setattr(TritonAttentionBackend, "init_forward_metadata", recording_init)
    expected = _run(tiny_model_dir, "torch", **CONFIGS[config])
    assert not steps
    assert _run(tiny_model_dir, "triton", **CONFIGS[config]) == expected

    # The paths the comparison is meant to cover were taken.
    assert any(all(e == 1 for e in ext) for _, ext in steps), "no decode-kernel step"
    assert any(p > 0 and e > 1 for pre, ext in steps for p, e in zip(pre, ext)), "no extend over a cached prefix"
    if config == "chunked":
        assert any(1 in ext and max(ext) > 1 for _, ext in steps), "no mixed decode + extend step"
