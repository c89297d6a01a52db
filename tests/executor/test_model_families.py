"""The families beyond Llama (Qwen3, Phi-3/4 with partial rotary and longrope, Mixtral,
Qwen3-MoE, Gemma 2 with its attention soft-capping and Gemma 3, Mistral and Qwen2 with sliding
windows), each a tiny random checkpoint made with transformers' own config class: greedy tokens
equal transformers' in float32 over 24 tokens, cold and warm, chunked, paged, and prompt
logprobs equal too; the sliding-window families on the Triton backend too, with prompts longer
than their window; tensor parallel on gloo for one dense and one MoE family; the routing and
grouped experts against transformers' own modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig

import radixrt as rt
from radixrt.config import ServerArgs
from radixrt.engine.scheduler import Scheduler
from radixrt.executor.model_runner import ModelRunner
from radixrt.kernels import int8_gemm
from radixrt.models.linear import Int8Linear
from radixrt.models.moe import GatedMLP, Routing, SparseMoE, grouped_experts, route

from helpers import TINY, assert_prompt_logprobs_match, hf_greedy, random_checkpoint, run_in_process
from timeouts import REPLY_TIMEOUT_S

MAX_NEW = 24
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
SMALL = dict(TINY, max_position_embeddings=512, pad_token_id=0, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2, router_jitter_noise=0.0)
WINDOW = 12  # shorter than the longer prompts: their local layers see only the last 12 tokens
GEMMA = dict(
    head_dim=32,
    query_pre_attn_scalar=8,
    sliding_window=WINDOW,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
)
FAMILIES = {
    # q/k RMSNorm per head; head_dim 32, not hidden / heads = 16
    "qwen3": ("qwen3", {"head_dim": 32}),
    # fused qkv_proj and gate_up_proj in the checkpoint; whole-head rotary
    "phi3": ("phi3", {}),
    # Phi-4-mini's shape: a quarter of each head not rotated, tied embeddings
    "phi4-partial-rotary": (
        "phi3",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
            },
        },
    ),
    # longrope served within original_max_position_embeddings (short factors, and the
    # attention factor of max / original = 4)
    "phi3-longrope": (
        "phi3",
        {
            "original_max_position_embeddings": 128,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [4.0] * 8,
                "original_max_position_embeddings": 128,
            },
        },
    ),
    "mixtral": ("mixtral", {"num_local_experts": 8, **MOE}),
    # top-k weights not renormalised; layer 1 dense (mlp_only_layers)
    "qwen3-moe": (
        "qwen3_moe",
        {"num_experts": 8, "moe_intermediate_size": 48, "mlp_only_layers": [1], **MOE},
    ),
    "qwen3-moe-renormalised": (
        "qwen3_moe",
        {"num_experts": 6, "moe_intermediate_size": 48, "norm_topk_prob": True, **MOE},
    ),
    # every layer within the window
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    # the window on the layers from max_window_layers on (here the second), the first global
    "qwen2-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    # (1 + w) norms, sqrt(hidden) embedding scale, GeGLU, sandwich norms, query_pre_attn_scalar
    # (8, not head_dim 32), final-logit soft-capping; local (windowed) and global layers
    # alternating; attention scores soft-capped (2, low enough to bite on these weights)
    "gemma2": ("gemma2", {**GEMMA, "attn_logit_softcapping": 2.0}),
    # and q/k norms, local and global layers with their own rope (theta 1e4; linear 8 x 1e6)
    "gemma3": (
        "gemma3_text",
        {
            **GEMMA,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        },
    ),
}


def _checkpoint(folder, tiny_model_dir, name: str):
    model_type, extra = FAMILIES[name]
    return random_checkpoint(folder, tiny_model_dir, model_type, {**SMALL, **extra}, seed=3)


WINDOWED = ["mistral-window", "qwen2-window", "gemma2", "gemma3"]


def _prompts() -> list[list[int]]:
    """Three sharing a 20-token prefix (the second and later hit the cache), one longer; all but
    the third longer than WINDOW."""
    shared = list(range(300, 320))
    return [shared + [501, 502], shared + [601, 602, 603], shared[:5], list(range(700, 745))]


def _matches_transformers(folder, backend: str, max_new: int = MAX_NEW) -> None:
    """Greedy tokens equal transformers', cold then warm (the same prompts again: cached),
    prefilled in 16-token chunks over 4-token pages."""
    prompts = _prompts()
    expected = hf_greedy(folder, prompts, max_new)
    scheduler = Scheduler.from_server_args(
        ServerArgs(
            model=str(folder),
            attention_backend=backend,
            max_total_tokens=1024,
            chunked_prefill_size=16,
            page_size=4,
        )
    )
    got = run_in_process(scheduler, [prompts, prompts], {**GREEDY, "max_new_tokens": max_new})
    assert got[: len(prompts)] == expected, "cold"
    assert got[len(prompts) :] == expected, "warm"
    assert scheduler.stats()["cached_prompt_tokens_total"] > 0, "the warm pass hit no cache"
    scheduler.check_invariants()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers_cold_warm_chunked_paged(name, tmp_path, tiny_model_dir):
    _matches_transformers(_checkpoint(tmp_path, tiny_model_dir, name), "torch")


@pytest.mark.parametrize("name", WINDOWED)
def test_sliding_window_family_on_triton_matches_transformers(name, tmp_path, tiny_model_dir):
    """The Triton kernels (interpreted) read only each windowed layer's window, as the torch
    path does: the same tokens as transformers, cold, warm, chunked and paged. Half the new
    tokens of the torch path's test (each decode step's kernels run interpreted): every prompt
    but the short one starts past the window already."""
    _matches_transformers(_checkpoint(tmp_path, tiny_model_dir, name), "triton", MAX_NEW // 2)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi4-partial-rotary", "qwen3-moe"])
def test_family_prompt_logprobs_equal_transformers(name, tmp_path, tiny_model_dir):
    """Every prompt position's log-probability of the next token, as transformers computes it:
    finer than greedy tokens (Gemma 2's final soft-cap leaves the argmax where it was)."""
    folder = _checkpoint(tmp_path, tiny_model_dir, name)
    ids = _prompts()[3]
    assert_prompt_logprobs_match(folder, ids)


@pytest.mark.parametrize("name, ep_size", [("qwen3", 1), ("mixtral", 1), ("mixtral", 2)])
def test_family_under_tensor_parallel_on_gloo(name, ep_size, tmp_path, tiny_model_dir):
    """Two ranks: heads, the MLP's intermediate dimension and the vocabulary split, and every
    expert's intermediate dimension (or, with `ep_size` 2, half the experts each, whole);
    greedy equal to transformers', cold and warm."""
    folder = _checkpoint(tmp_path, tiny_model_dir, name)
    prompts = _prompts()[:2]
    expected = hf_greedy(folder, prompts, MAX_NEW)
    with rt.Engine(
        model=str(folder),
        tp_size=2,
        ep_size=ep_size,
        max_total_tokens=512,
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
    ) as engine:
        for attempt in ("cold", "warm"):
            got = [
                o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)
            ]
            assert got == expected, attempt


@pytest.mark.skipif(not int8_gemm.available(), reason="int8 needs AVX2 and a compiler")
def test_moe_int8_replaces_every_experts_linears(tmp_path, tiny_model_dir):
    """`--quantization int8` reaches the experts (and the router), not only attention and the
    head: no float `nn.Linear` is left, the experts' weights count as int8, and each int8 expert
    computes its float32 twin's output within 2% (the whole model's logits are not compared: an
    int8 router may pick other experts for a near tie; int8's quality gates are
    test_quantization.py's)."""
    folder = _checkpoint(tmp_path, tiny_model_dir, "mixtral")
    runners = {
        q: ModelRunner(ServerArgs(model=str(folder), max_total_tokens=512, quantization=q).executor)
        for q in (None, "int8")
    }
    model = runners["int8"].model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    experts = [e for m in model.modules() if isinstance(m, SparseMoE) for e in m.experts]
    assert len(experts) == TINY["num_hidden_layers"] * 8
    assert all(
        isinstance(e.gate_up_proj, Int8Linear) and isinstance(e.down_proj, Int8Linear)
        for e in experts
    )
    assert runners["int8"].weights.weight_bytes * 4 == runners[None].weights.weight_bytes
    floats = [
        e for m in runners[None].model.modules() if isinstance(m, SparseMoE) for e in m.experts
    ]
    x = torch.randn(5, TINY["hidden_size"])
    with torch.no_grad():
        for ours, theirs in zip(experts, floats):
            want = theirs(x)
            error = float((ours(x) - want).norm() / want.norm())
            assert error < 0.02, f"an int8 expert {error:.4f} off its float32 output (relative)"


# ---- the routing math and the grouped experts, against transformers' own modules -----------
def _moe_config(model_type: str, **extra):
    experts = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts"}[model_type]
    return AutoConfig.for_model(
        model_type,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=48,
        num_experts_per_tok=3,
        **{experts: 7},
        **extra,
    )


@pytest.mark.parametrize(
    "model_type, extra, renormalize",
    [
        ("mixtral", {}, True),
        ("qwen3_moe", {}, False),
        ("qwen3_moe", {"norm_topk_prob": True}, True),
    ],
)
def test_routing_is_each_familys(model_type, extra, renormalize):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = _moe_config(model_type, **extra)
    router = {"mixtral": MixtralTopKRouter, "qwen3_moe": Qwen3MoeTopKRouter}[model_type](config)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(40, 32)
    logits, weights, experts = router(x)
    got = route(logits, 3, renormalize)
    assert torch.equal(got.experts, experts)
    torch.testing.assert_close(got.weights, weights.float(), rtol=0, atol=0)
    if renormalize:
        torch.testing.assert_close(got.weights.sum(-1), torch.ones(40))


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_experts_equal_transformers_experts(tokens):
    """Every token's experts run once each over the rows routed to them; the sum per token is
    transformers' (experts in ascending order), some experts receiving no token."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = _moe_config("mixtral")
    theirs = MixtralExperts(config)
    torch.manual_seed(1)
    torch.nn.init.normal_(theirs.gate_up_proj, std=0.2)
    torch.nn.init.normal_(theirs.down_proj, std=0.2)
    ours = [GatedMLP(32, 48, "silu") for _ in range(7)]
    for e, expert in enumerate(ours):
        expert.gate_up_proj.weight.data.copy_(theirs.gate_up_proj[e])
        expert.down_proj.weight.data.copy_(theirs.down_proj[e])
    x = torch.randn(tokens, 32)
    routing = route(torch.randn(tokens, 7) * 3, 3, True)
    with torch.no_grad():
        expected = theirs(x, routing.experts, routing.weights)
        got = grouped_experts(x, routing, ours)
        empty = grouped_experts(x[:0], Routing(routing.experts[:0], routing.weights[:0]), ours)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert empty.shape == (0, 32)
