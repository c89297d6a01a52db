"""The runtime on the Triton backend (interpreted on CPU) gives the torch backend's greedy tokens."""

import pytest

from radixrt.attention import triton_backend
from radixrt.attention.triton_backend import TritonAttentionBackend
from radixrt.kernels import decode_attention, extend_attention
from radixrt.mem_cache.kv_quant import parse_kv_format

from helpers import LaunchSpy, make_scheduler, requests_in_process, run_in_process
from ownership import assert_no_leak

SAMPLING = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
SHARED = list(range(300, 311))
# Different lengths over one shared prefix, so chunked prefills overlap other requests' decodes.
PROMPTS = [
    SHARED + [501, 502, 503],
    SHARED + [601],
    SHARED[:3],
    SHARED + [701, 702, 703, 704, 705, 706],
]
# Warm passes: the same prompts (fully cached), then each with new tokens after its cached part.
PASSES = [PROMPTS, PROMPTS, [p + [800 + i, 900 + i] for i, p in enumerate(PROMPTS)]]
CONFIGS = {
    "whole": {},
    "chunked": {"chunked_prefill_size": 4},
    # warm passes draft what the cold ones said: verification runs the extend kernel
    "speculative": {"speculative_algorithm": "ngram"},
    # quantized pools (`--kv-cache-dtype`): both backends read the same rows, dequantized
    "fp8_e4m3 KV": {"kv_cache_dtype": "fp8_e4m3"},
    "int8 KV, chunked": {"kv_cache_dtype": "int8", "chunked_prefill_size": 4},
}


def _run(model_dir, backend: str, **args) -> list[list[int]]:
    """Greedy tokens of every pass, cold then prefix-cached, and the pool's bookkeeping after.

    The scheduler runs in this process (not behind `rt.Engine`) so the test can watch its steps."""
    scheduler = make_scheduler(model_dir, attention_backend=backend, **args)
    outs = run_in_process(scheduler, PASSES, SAMPLING)
    assert_no_leak(scheduler)
    return outs


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_triton_backend_matches_torch(tiny_model_dir, monkeypatch, config):
    steps, kinds = [], set()
    init = TritonAttentionBackend.init_forward_metadata

    def recording_init(self, batch):
        steps.append((list(batch.prefix_lens), list(batch.extend_lens)))
        kinds.add(self.kv_kind)
        init(self, batch)

    monkeypatch.setattr(TritonAttentionBackend, "init_forward_metadata", recording_init)
    expected = _run(tiny_model_dir, "torch", **CONFIGS[config])
    assert not steps
    assert _run(tiny_model_dir, "triton", **CONFIGS[config]) == expected

    # The paths the comparison is meant to cover were taken.
    assert any(all(e == 1 for e in ext) for _, ext in steps), "no decode-kernel step"
    assert any(p > 0 and e > 1 for pre, ext in steps for p, e in zip(pre, ext)), (
        "no extend over a cached prefix"
    )
    fmt = parse_kv_format(CONFIGS[config].get("kv_cache_dtype", "auto"))
    assert kinds == {fmt.kernel_kind if fmt else None}, "the kernels read another pool format"
    if "chunked" in config:
        assert any(1 in ext and max(ext) > 1 for _, ext in steps), "no mixed decode + extend step"


def test_triton_backend_small_tiles_matches_torch(tiny_model_dir, monkeypatch):
    """With 16-token tiles and a split every 8 keys, the model's prompts span several query and key
    tiles and decodes several KV splits; the kernels ran with those sizes, and the greedy tokens
    still equal the torch backend's."""
    expected = _run(tiny_model_dir, "torch", **CONFIGS["whole"])
    monkeypatch.setattr(
        extend_attention, "_launch_config", lambda block_d: {"BLOCK_M": 16, "BLOCK_N": 16}
    )
    monkeypatch.setattr(decode_attention, "_launch_config", lambda block_d: {"BLOCK_N": 16})
    monkeypatch.setattr(triton_backend, "MIN_SPLIT_LEN", 8)
    extend = LaunchSpy(extend_attention._extend_kernel)
    decode = LaunchSpy(decode_attention._decode_split_kernel)
    monkeypatch.setattr(extend_attention, "_extend_kernel", extend)
    monkeypatch.setattr(decode_attention, "_decode_split_kernel", decode)
    assert _run(tiny_model_dir, "triton", **CONFIGS["whole"]) == expected

    assert extend.launches and decode.launches
    assert all((kw["BLOCK_M"], kw["BLOCK_N"]) == (16, 16) for _, kw in extend.launches)
    assert all(kw["BLOCK_N"] == 16 for _, kw in decode.launches)
    assert max(grid[2] for grid, _ in extend.launches) > 1, "no extend spanned two query tiles"
    assert max(grid[2] for grid, _ in decode.launches) > 1, "no decode ran several KV splits"


def _logprobs_in_process(scheduler, batches: list[list[list[int]]]) -> list[tuple]:
    """Greedy tokens with each one's logprob and top-5, every batch after the one before."""
    params = {**SAMPLING, "max_new_tokens": 3, "return_logprob": True, "top_logprobs_num": 5}
    reqs = requests_in_process(scheduler, batches, params)
    return [(r.output_ids, r.output_token_logprobs, r.output_top_logprobs) for r in reqs]


def test_deterministic_rows_do_not_depend_on_batch_cache_or_chunks(tiny_model_dir):
    """`--enable-deterministic-inference` on the Triton backend: each prompt's tokens, logprobs
    and top-5 are the same bits alone on a cold cache, together in one batch with their shared
    prefix cached, and prefilled in chunks of 4 (two prompts: the interpreter is slow)."""
    prompts = PROMPTS[:2]
    scheduler = make_scheduler(
        tiny_model_dir, attention_backend="triton", enable_deterministic_inference=True
    )
    alone = []
    for p in prompts:
        scheduler.flush_cache()
        alone += _logprobs_in_process(scheduler, [[p]])
    # the first prompt cached, then both together: the second's shared prefix comes from the cache
    together = _logprobs_in_process(scheduler, [prompts])
    assert together == alone
    assert_no_leak(scheduler)
    chunked = make_scheduler(
        tiny_model_dir,
        attention_backend="triton",
        enable_deterministic_inference=True,
        chunked_prefill_size=4,
    )
    assert _logprobs_in_process(chunked, [prompts]) == alone


def test_quantized_rows_from_the_host_tier(tiny_model_dir):
    """fp8 rows pushed out of a 64-token pool to the host tier by two other prompts, loaded
    back as bytes when their prompt returns, then read by the Triton kernels: the torch
    backend's greedy tokens on the same tiers."""
    tiers = {"kv_cache_dtype": "fp8_e4m3", "enable_hierarchical_cache": True}
    first, others = list(range(300, 330)), [list(range(400, 430)), list(range(500, 530))]
    passes = [[first], *([p] for p in others), [first + [801, 802]]]
    outs = {}
    for backend in ("torch", "triton"):
        scheduler = make_scheduler(
            tiny_model_dir, attention_backend=backend, max_total_tokens=64, **tiers
        )
        outs[backend] = run_in_process(scheduler, passes, SAMPLING)
        assert scheduler.stats()["host_hit_tokens"] > 0, "nothing was loaded back"
        assert_no_leak(scheduler)
    assert outs["triton"] == outs["torch"]
