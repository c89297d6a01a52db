"""Llama-family variants and the incremental detokenizer, against transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import radixrt as rt
from radixrt.engine.detokenizer import IncrementalDetokenizer

from helpers import TINY, hf_greedy, make_scheduler
from timeouts import REPLY_TIMEOUT_S

SMALL = dict(TINY, max_position_embeddings=512)
VARIANTS = {
    "qwen2-qkv-bias": ("qwen2", {"tie_word_embeddings": False}),
    "mistral": ("mistral", {"tie_word_embeddings": False, "sliding_window": None}),
    "llama3-rope-scaling": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "llama-linear-rope-no-gqa": (
        "llama",
        {
            "num_key_value_heads": 4,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        },
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_transformers(name, tmp_path, tiny_model_dir):
    model_type, extra = VARIANTS[name]
    config = AutoConfig.for_model(model_type, **{**SMALL, **extra})
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(tmp_path)
    prompts = [
        tokenizer.encode(t, add_special_tokens=False)
        for t in [
            "The quick brown fox jumps over the lazy dog and then",
            "The quick brown fox sleeps",
            "Hello",
        ]
    ]
    expected = hf_greedy(tmp_path, prompts, 8)
    with rt.Engine(
        model=str(tmp_path), max_total_tokens=1024, log_level="warning", timeout=REPLY_TIMEOUT_S
    ) as engine:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
    assert [o["output_ids"] for o in outs] == expected


def test_incremental_detokenizer_never_splits_a_character(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    text = "Café → 世界! 🎉🚀 naïve façade, Ελληνικά and emoji 👩‍💻."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tokenizer, prompt_ids=tokenizer.encode("Say:", add_special_tokens=False)
    )
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens were only parts of a character


def test_prepacked_linear_matches_f_linear_and_replaces_every_linear():
    from radixrt.kernels.cpu_isa import Isa
    from radixrt.models.linear import LinearPacking, PrepackedLinear, prepack_available

    if not prepack_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 96), torch.nn.Sequential(torch.nn.Linear(96, 8, bias=False))
    )
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    LinearPacking(None, Isa.AVX2).replace(model)
    assert isinstance(model[0], PrepackedLinear) and isinstance(model[1][0], PrepackedLinear)
    for rows in (1, 5, 70):  # any row count, not only the one the layout was tuned for
        x = torch.randn(rows, 64)
        torch.testing.assert_close(
            model[0](x), torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5
        )


def test_the_torch_glue_matches_transformers_too(tiny_model_dir, monkeypatch):
    """Where the fused C glue cannot run (no compiler; CUDA), the layers use torch ops for the
    norms, rotary, K/V store and SiLU: greedy output still equals transformers', prefix-cached
    and chunked."""
    from radixrt.kernels import cpu_fused

    from helpers import run_in_process

    monkeypatch.setattr(cpu_fused, "supports", lambda x: False)
    monkeypatch.setattr(cpu_fused, "rms_norm", None)  # a call would fail loudly
    shared = list(range(300, 320))
    prompts = [shared + [501, 502], shared + [601, 602, 603], shared[:5]]
    scheduler = make_scheduler(tiny_model_dir, attention_backend="auto", chunked_prefill_size=8)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    got = run_in_process(scheduler, [prompts, prompts], params)
    assert got == hf_greedy(tiny_model_dir, prompts, 6) * 2
    scheduler.check_invariants()


def test_float16_greedy_tokens_and_logprobs_follow_float32(tiny_model_dir):
    """`--dtype float16` (weights, KV and activations in half precision, on the CPU too):
    the tiny model's greedy tokens equal float32's, their logprobs within 0.05."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [
        tokenizer.encode(t, add_special_tokens=False)
        for t in ["The quick brown fox jumps over the lazy dog and then", "Hello"]
    ]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    outs = {}
    for dtype in ("float32", "float16"):
        with rt.Engine(
            model=str(tiny_model_dir),
            dtype=dtype,
            max_total_tokens=1024,
            log_level="warning",
            timeout=REPLY_TIMEOUT_S,
        ) as engine:
            outs[dtype] = engine.generate(input_ids=prompts, sampling_params=params)
    for full, half in zip(outs["float32"], outs["float16"]):
        assert half["output_ids"] == full["output_ids"]
        logprobs = [
            torch.tensor([lp for lp, _ in o["meta_info"]["output_token_logprobs"]])
            for o in (full, half)
        ]
        assert torch.allclose(*logprobs, atol=0.05, rtol=0)
