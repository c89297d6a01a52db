"""Families whose layers carry a state per request besides their KV, each a tiny random
checkpoint made with transformers' own config class: LFM2 (short convolutions between attention
layers) and Qwen3.5 (Gated DeltaNet linear attention, three layers to each gated attention
layer). Greedy tokens equal transformers' in float32, prompts batched together, prefilled in
chunks over pages, preempted, and again when the same prompts come back: resumed from the state
snapshots the radix tree keeps (where a request ended, and where two branched), with the state
slots' bookkeeping checked at every step; what such a model cannot be served with is refused at
start by name."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from radixrt.config import ServerArgs
from radixrt.distributed.group import TPGroup
from radixrt.engine.scheduler import Scheduler
from radixrt.models import model_class
from radixrt.models.lfm2 import Lfm2ForCausalLM
from radixrt.sampling_params import SamplingParams

from helpers import QWEN3_5, TINY, hf_greedy, launch_runtime, random_checkpoint
from timeouts import REPLY_TIMEOUT_S

MAX_NEW = 24
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
LFM2 = dict(
    TINY,
    num_hidden_layers=4,
    layer_types=["conv", "full_attention", "conv", "conv"],
    conv_L_cache=3,
    block_multiple_of=32,
    max_position_embeddings=512,
    pad_token_id=0,
)
# experts (two of four per token) and a shared expert on every layer but Qwen3-Next's second
EXPERTS = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
# three Mamba-2 layers to one attention layer; 8 heads of 16 in 2 groups of B and C; chunks
# of 8 tokens, so a 16-token prefill chunk is two SSD chunks
BAMBA = dict(
    TINY,
    num_hidden_layers=4,
    attn_layer_indices=[1],
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=8,
    max_position_embeddings=512,
    pad_token_id=0,
)
# Granite 4: Bamba's Mamba-2 shape and its own scalars; dense (its shared MLP alone) without
# positions in attention (the -h models' "nope"), or with four experts (two per token) beside
# the shared MLP and rotary attention
GRANITE4 = dict(
    {k: v for k, v in BAMBA.items() if k != "attn_layer_indices"},
    layer_types=["mamba", "attention", "mamba", "mamba"],
    shared_intermediate_size=96,
    num_local_experts=0,
    position_embedding_type="nope",
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.2,
    logits_scaling=2.5,
)
GRANITE4_EXPERTS = dict(
    num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, position_embedding_type="rope"
)
# Falcon-H1: attention and Mamba-2 side by side on every layer, the Mamba width its own
# (`mamba_d_ssm`: 8 heads of 12), every multiplier other than 1 so that each counts; as the
# released models, no gated norm; or one normed before the gate, biased projections
FALCON_H1 = dict(
    TINY,
    num_hidden_layers=3,
    mamba_d_ssm=96,
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=8,
    mamba_rms_norm=False,
    embedding_multiplier=4.0,
    lm_head_multiplier=0.6,
    mlp_multipliers=[0.7, 1.3],
    key_multiplier=0.5,
    attention_in_multiplier=0.9,
    attention_out_multiplier=1.2,
    ssm_in_multiplier=1.1,
    ssm_out_multiplier=0.1,
    ssm_multipliers=[0.8, 1.25, 0.9, 1.1, 0.5],
    max_position_embeddings=512,
    pad_token_id=0,
)
FALCON_H1_NORMED = dict(
    mamba_rms_norm=True, mamba_norm_before_gate=True, mamba_proj_bias=True, projectors_bias=True
)
FAMILIES = {"lfm2": ("lfm2", LFM2), "qwen3_5": ("qwen3_5_text", QWEN3_5)}
# families checked for exactness (cold, warm, chunked, preempted, an agent loop) only: the rest
# of this module's tests exercise the state slots, which they share with the two above
MORE: dict[str, tuple[str, dict]] = {
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(QWEN3_5, **EXPERTS)),
    "qwen3_next": ("qwen3_next", dict(QWEN3_5, **EXPERTS, mlp_only_layers=[1])),
    "bamba": ("bamba", BAMBA),
    "granite4": ("granitemoehybrid", GRANITE4),
    "granite4_moe": ("granitemoehybrid", dict(GRANITE4, **GRANITE4_EXPERTS)),
    "falcon_h1": ("falcon_h1", FALCON_H1),
    "falcon_h1_normed": ("falcon_h1", dict(FALCON_H1, **FALCON_H1_NORMED)),
}


def _checkpoint(folder, tiny_model_dir, name: str):
    model_type, shape = {**FAMILIES, **MORE}[name]
    return random_checkpoint(folder, tiny_model_dir, model_type, shape, seed=5)


@pytest.fixture(scope="module", params=list(FAMILIES))
def hybrid(request, tmp_path_factory, tiny_model_dir):
    return _checkpoint(tmp_path_factory.mktemp(request.param), tiny_model_dir, request.param)


@pytest.fixture(scope="module", params=list(FAMILIES) + list(MORE))
def any_hybrid(request, tmp_path_factory, tiny_model_dir):
    return _checkpoint(tmp_path_factory.mktemp(request.param), tiny_model_dir, request.param)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory, tiny_model_dir):
    return _checkpoint(tmp_path_factory.mktemp("lfm2"), tiny_model_dir, "lfm2")


def _prompts() -> list[list[int]]:
    """Two sharing a 20-token prefix, one of 5 tokens, one of 45 (three 16-token chunks)."""
    shared = list(range(300, 320))
    return [shared + [501, 502], shared + [601, 602, 603], shared[:5], list(range(700, 745))]


def _scheduler(folder, pool: int, page_size: int = 4, **flags) -> Scheduler:
    return Scheduler.from_server_args(
        ServerArgs(
            model=str(folder),
            attention_backend="torch",
            max_total_tokens=pool,
            chunked_prefill_size=16,
            page_size=page_size,
            **flags,
        )
    )


def _run(scheduler: Scheduler, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Each prompt's greedy tokens, the pool's and the states' bookkeeping checked each step."""
    reqs = []
    for i, ids in enumerate(prompts):
        params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": max_new})
        reqs.append(scheduler.make_request(f"r{len(reqs)}-{i}", ids, params))
        scheduler.add_request(reqs[-1])
    while scheduler.has_work():
        scheduler.step()
        scheduler.check_invariants()
    return [r.output_ids for r in reqs]


@cache
def _expected(folder: Path) -> list[list[int]]:
    """transformers' greedy tokens for `_prompts()` (the same for each pool a checkpoint runs
    with)."""
    return hf_greedy(folder, _prompts(), MAX_NEW)


PREEMPTED = {"enable_hierarchical_cache": False}
SWAPPED = {"enable_hierarchical_cache": True, "preemption_mode": "swap", "hicache_ratio": 4.0}


@pytest.mark.parametrize(
    "pool, tiers",
    [(1024, PREEMPTED), (72, PREEMPTED), (72, SWAPPED)],
    ids=["roomy", "preempted", "swapped"],
)
def test_matches_transformers_batched_chunked_and_resent(any_hybrid, pool, tiers):
    """The four prompts together, then again: the second pass resumes from the snapshots the
    first left (each request's at its end, and one where the two sharing a prefix branch). With
    a pool of 72 tokens the four (193 tokens in all) cannot run together: some are retracted
    (leaving a snapshot where their computed tokens end) and admitted again: recomputed, or,
    swapped, their KV loaded back from the host tier and their state resumed from the snapshot
    (which stays in its slot while the host holds the KV)."""
    prompts = _prompts()
    expected = _expected(any_hybrid)
    scheduler = _scheduler(any_hybrid, pool, max_mamba_cache_size=8, **tiers)
    assert scheduler.runner.model.recurrent and scheduler.runner.state_bytes > 0
    assert _run(scheduler, prompts, MAX_NEW) == expected, "first"
    first = scheduler.stats()
    assert _run(scheduler, prompts, MAX_NEW) == expected, "resent"
    stats = scheduler.stats()
    assert stats["state_total_slots"] == 8
    if pool < 1024:  # the pool evicts what the next requests would match
        assert stats["num_preemptions"] > 0
    else:
        assert stats["cached_prompt_tokens_total"] > first["cached_prompt_tokens_total"]
        assert stats["state_cached_slots"] > 0
    if tiers is SWAPPED:  # retracted KV went to the host, and KV came back from it
        assert stats["swapped_out_tokens"] > 0
        assert stats["host_hit_tokens"] + stats["swapped_in_tokens"] > 0


def test_agent_loop_resumes_each_turn_from_the_last(any_hybrid):
    """Each turn resends the whole conversation and adds to it: every turn but the first
    resumes from the snapshot the previous turn left at its end (all but the new turn's
    tokens cached), and its tokens equal transformers' on the whole conversation. Pages of one
    token (the default), so every request's end is a page's end, where a snapshot is kept."""
    scheduler = _scheduler(any_hybrid, 1024, page_size=1)
    conversation = list(range(300, 330))
    before = 0
    for turn in range(4):
        got = _run(scheduler, [conversation], 8)[0]
        assert [got] == hf_greedy(any_hybrid, [conversation], 8), turn
        if turn:
            cached = scheduler.stats()["cached_prompt_tokens_total"] - before
            assert cached >= len(conversation) - 8 - 12, (turn, cached)
        before = scheduler.stats()["cached_prompt_tokens_total"]
        conversation = conversation + got + [400 + turn * 10 + i for i in range(12)]


def test_a_restarted_server_resumes_a_seen_conversation_from_disk(hybrid, tmp_path):
    """The disk tier holds states too: a 150-token prompt's prefill stops at its last block
    boundary (128: blocks of 64), where its state is stored beside the blocks' KV. After a
    restart (another scheduler on the same directory) the conversation's next turn reads the
    two blocks and that state from disk and resumes there; every answer is transformers'."""
    tiers = {"enable_hierarchical_cache": True, "hicache_storage_dir": str(tmp_path)}
    prompt = [100 + (7 * i) % 900 for i in range(150)]
    scheduler = _scheduler(hybrid, 1024, page_size=1, **tiers)
    first = _run(scheduler, [prompt], 4)[0]
    scheduler.close()
    assert [first] == hf_greedy(hybrid, [prompt], 4)
    assert len(list(tmp_path.glob("*-state.safetensors"))) == 1
    turn = prompt + first + [9, 10, 11]
    scheduler = _scheduler(hybrid, 1024, page_size=1, **tiers)
    assert _run(scheduler, [turn], 4) == hf_greedy(hybrid, [turn], 4)
    stats = scheduler.stats()
    scheduler.close()
    assert stats["storage_hit_tokens"] == stats["cached_prompt_tokens_total"] == 128


def test_a_shared_prompt_resumes_from_the_prefill_snapshot_then_the_branch_point(hybrid):
    """Four requests share a 300-token prompt, sent at once. The first computes it whole, its
    prefill stopping for a snapshot at 256 tokens; the others resume there (or, admitted after
    one of them stopped at 300, where they branch, from there). A fifth, sent after, resumes at
    the branch point. Every answer is transformers'."""
    scheduler = _scheduler(hybrid, 4096, page_size=1)
    shared = [1000 + (7 * i) % 3000 for i in range(300)]
    prompts = [shared + [200 + 10 * r + j for j in range(10)] for r in range(5)]
    assert _run(scheduler, prompts[:4], 4) == hf_greedy(hybrid, prompts[:4], 4)
    before = scheduler.stats()["cached_prompt_tokens_total"]
    assert before >= 3 * 256
    assert _run(scheduler, prompts[4:], 4) == hf_greedy(hybrid, prompts[4:], 4)
    assert scheduler.stats()["cached_prompt_tokens_total"] - before == 300


def test_aborts_leave_no_state_slot_behind(hybrid):
    """Requests aborted mid-prefill and mid-decode give their state slots back (or to the tree,
    as snapshots of what they computed); the others still answer as transformers does, and once
    all have ended every slot is free or a snapshot."""
    scheduler = _scheduler(hybrid, 1024)
    prompts = _prompts()
    params = SamplingParams.from_dict(GREEDY)
    reqs = [scheduler.make_request(f"a{i}", ids, params) for i, ids in enumerate(prompts)]
    for req in reqs:
        scheduler.add_request(req)
    for step in range(6):
        scheduler.step()
        scheduler.check_invariants()
        if step == 1:
            scheduler.abort("a3")  # 45 tokens in chunks of 16: still prefilling
        if step == 4:
            scheduler.abort("a0")
    while scheduler.has_work():
        scheduler.step()
        scheduler.check_invariants()
    assert [reqs[1].output_ids, reqs[2].output_ids] == hf_greedy(hybrid, prompts[1:3], MAX_NEW)
    stats = scheduler.stats()
    assert stats["state_free_slots"] + stats["state_cached_slots"] == stats["state_total_slots"]


def test_lfm2_snapshots_are_dropped_least_recent_first_when_slots_run_out(lfm2):
    """Three state slots. Eight different prompts one after the other each leave a snapshot at
    their end; the slots keep the last three, the earlier ones were dropped least recent first
    (their KV stays cached, but no longer resumes a request). A prompt that continues the last
    conversation resumes from its snapshot; one that continues the first is computed again. Every
    answer is transformers'."""
    scheduler = _scheduler(lfm2, 1024, page_size=1, max_mamba_cache_size=3)
    prompts = [[100 + 7 * i + j for j in range(20)] for i in range(8)]
    outs = [_run(scheduler, [ids], 4)[0] for ids in prompts]
    assert outs == hf_greedy(lfm2, prompts, 4)
    stats = scheduler.stats()
    assert stats["state_total_slots"] == 3 and stats["state_cached_slots"] == 3
    before = stats["cached_prompt_tokens_total"]
    again = [prompts[i] + outs[i][:3] + [9] for i in (7, 0)]
    assert [_run(scheduler, [ids], 4)[0] for ids in again] == hf_greedy(lfm2, again, 4)
    assert scheduler.stats()["cached_prompt_tokens_total"] - before == len(again[0]) - 1


def test_lfm2_keeps_the_snapshot_that_saves_most_when_slots_run_out(lfm2):
    """Three state slots: a 200-token conversation's end, then three newer 20-token one-off
    prompts. The fourth request needs a slot: least recently used would drop the conversation's
    snapshot; weighed by what each saves (`least_worth`), the first one-off prompt's goes, and
    the conversation's next turn resumes from its end. Every answer is transformers'."""
    scheduler = _scheduler(lfm2, 1024, page_size=1, max_mamba_cache_size=3)
    conversation = [100 + (7 * i) % 900 for i in range(200)]
    prompts = [conversation] + [[2000 + 30 * i + j for j in range(20)] for i in range(3)]
    outs = [_run(scheduler, [ids], 4)[0] for ids in prompts]
    assert outs == hf_greedy(lfm2, prompts, 4)
    before = scheduler.stats()["cached_prompt_tokens_total"]
    turn = conversation + outs[0][:3] + [9, 10]
    assert _run(scheduler, [turn], 4) == hf_greedy(lfm2, [turn], 4)
    assert scheduler.stats()["cached_prompt_tokens_total"] - before >= len(conversation)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"speculative_algorithm": "ngram"}, "--speculative-algorithm: Lfm2ForCausalLM"),
        ({"enable_lora": True}, "Lfm2ForCausalLM declares no projections"),
    ],
)
def test_lfm2_refuses_what_its_state_cannot_follow(lfm2, flags, message):
    args = ServerArgs(model=str(lfm2), max_total_tokens=256, **flags)
    with pytest.raises(ValueError, match=message):
        Scheduler.from_server_args(args)


@pytest.mark.parametrize(
    "name, field, value, message",
    [
        ("lfm2", "conv_L_cache", 10**6, "conv_L_cache is 1000000; radixrt takes 2 to 64"),
        ("lfm2", "layer_types", ["conv"] * 3, "layer_types names 3 layers, num_hidden_layers is 4"),
        (
            "qwen3_5",
            "linear_num_value_heads",
            3,
            "linear_num_value_heads \\(3\\) is not a multiple",
        ),
        ("qwen3_5", "linear_conv_kernel_dim", 1, "linear_conv_kernel_dim is 1"),
    ],
)
def test_a_config_out_of_bounds_is_refused_by_field(
    tmp_path, tiny_model_dir, name, field, value, message
):
    config = AutoConfig.from_pretrained(_checkpoint(tmp_path, tiny_model_dir, name))
    setattr(config, field, value)
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        model_class(config)(config, 64)


def test_a_huge_max_mamba_cache_size_is_refused_before_it_is_allocated(lfm2):
    with pytest.raises(ValueError, match="--max-mamba-cache-size 1000000000000: .* do not fit"):
        _scheduler(lfm2, 256, max_mamba_cache_size=10**12)


def test_lfm2_is_served_on_one_rank(lfm2):
    config = AutoConfig.from_pretrained(lfm2)
    with torch.device("meta"), pytest.raises(ValueError, match="one rank"):
        Lfm2ForCausalLM(config, 64, TPGroup(size=2, rank=0))


def test_state_slots_by_default_take_no_more_than_the_kv_pools_bytes(hybrid):
    """Unset, --max-mamba-cache-size is two slots per running request, but no more than the
    KV pool's bytes hold (at least two)."""
    for pool in (64, 4096):
        scheduler = _scheduler(hybrid, pool)
        slots, runner = scheduler.stats()["state_total_slots"], scheduler.runner
        assert 2 <= slots <= 2 * scheduler.args.max_running_requests
        assert slots == 2 or runner.state_bytes <= runner.kv_pool.bytes_per_token * pool


def test_the_recurrent_state_is_kept_in_mamba_ssm_dtype(tmp_path, tiny_model_dir):
    """`--mamba-ssm-dtype bfloat16`: Qwen3.5's delta-rule states are held in bfloat16 (half
    the bytes of float32's) and computed in float32; a request resumed from a snapshot so held
    still decodes."""
    folder = _checkpoint(tmp_path, tiny_model_dir, "qwen3_5")
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        scheduler = _scheduler(folder, 1024, page_size=1, mamba_ssm_dtype=dtype)
        sizes[dtype] = scheduler.runner.state_bytes / scheduler.stats()["state_total_slots"]
        states = [m.state for m in scheduler.runner.model.modules() if hasattr(m, "conv_state")]
        assert {s.dtype for s in states} == {getattr(torch, dtype)}
        first = _run(scheduler, [list(range(300, 330))], 4)[0]
        again = _run(scheduler, [list(range(300, 330)) + first[:3] + [9]], 4)[0]
        assert len(again) == 4 and scheduler.stats()["cached_prompt_tokens_total"] == 33
    assert sizes["bfloat16"] < sizes["float32"]


EXAMPLES = Path(__file__).parents[2] / "examples"


def test_every_example_runs_against_a_qwen3_5_server(tmp_path, tiny_model_dir):
    """Each program in examples/ (the DSL: gen, select, fork, roles, run_batch, tool calls)
    runs to its end against a runtime serving a tiny Qwen3.5 checkpoint over ZeroMQ, unchanged;
    the runtime's prefixes were reused through state snapshots, and every slot, KV page and
    state slot still has one owner."""
    folder = _checkpoint(tmp_path, tiny_model_dir, "qwen3_5")
    template = tiny_model_dir / "chat_template.jinja"
    (folder / template.name).write_bytes(template.read_bytes())
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES)}
    with launch_runtime(folder, max_total_tokens=16384) as runtime:
        for script in sorted(EXAMPLES.glob("[!_]*.py")):
            if script.name == "demo.py":  # starts runtimes of the default model
                continue
            done = subprocess.run(
                [sys.executable, "-P", str(script), runtime.zmq_url],
                env=env,
                capture_output=True,
                text=True,
                timeout=REPLY_TIMEOUT_S,
            )
            assert done.returncode == 0, (script.name, done.stderr[-2000:])
        stats = runtime.stats()
        assert stats["cached_prompt_tokens_total"] > 0 and stats["state_cached_slots"] > 0
        assert runtime.check_invariants()
