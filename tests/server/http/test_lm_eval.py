"""lm-evaluation-harness itself against the gateway (issue 29): `local-completions` in
loglikelihood and generate_until mode and `local-chat-completions` generate_until, on a tiny task
shipped in tests/data/lm_eval, give per sample what its `hf` model gives on the same weights."""

from __future__ import annotations

import pytest
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from helpers import DATA

TASKS = DATA / "lm_eval"
MC, GEN = "radixrt_tiny_mc", "radixrt_tiny_gen"
LOGLIKELIHOOD_ATOL = 1e-3  # float32 sums of a few logprobs, batched differently


@pytest.fixture(scope="module")
def runtime(tiny_runtime):
    return tiny_runtime


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """lm_eval's task registry with ours; the task's data files are relative to the working
    directory, datasets' cache kept out of the user's."""
    with pytest.MonkeyPatch.context() as env:
        env.chdir(TASKS)
        env.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
        yield TaskManager(include_path=str(TASKS), include_defaults=False)


def _samples(tasks: TaskManager, task: str, model: str, model_args: dict, chat: bool = False):
    """Each document's responses, in document order."""
    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=tasks,
        apply_chat_template=chat,
        log_samples=True,
        bootstrap_iters=0,
    )
    return [s["resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


def _hf(tiny_model_dir) -> dict:
    return {"pretrained": str(tiny_model_dir), "dtype": "float32", "device": "cpu", "batch_size": 1}


def _api(runtime, tiny_model_dir, path: str) -> dict:
    return {
        "model": "tiny",
        "base_url": f"{runtime.http_url}/v1/{path}",
        "tokenizer": str(tiny_model_dir),
        "tokenizer_backend": "huggingface",
        "num_concurrent": 1,
        "max_retries": 1,
    }


def test_loglikelihoods_equal_hf(runtime, tasks, tiny_model_dir):
    ours = _samples(tasks, MC, "local-completions", _api(runtime, tiny_model_dir, "completions"))
    theirs = _samples(tasks, MC, "hf", _hf(tiny_model_dir))
    assert len(ours) == len(theirs) == 6
    for doc_ours, doc_theirs in zip(ours, theirs, strict=True):
        for [(ll, greedy)], [(hf_ll, hf_greedy)] in zip(doc_ours, doc_theirs, strict=True):
            assert ll == pytest.approx(hf_ll, abs=LOGLIKELIHOOD_ATOL) and greedy == hf_greedy


@pytest.mark.parametrize(
    "model, path, chat",
    [
        ("local-completions", "completions", False),
        ("local-chat-completions", "chat/completions", True),
    ],
)
def test_generations_equal_hf(runtime, tasks, tiny_model_dir, model, path, chat):
    ours = _samples(tasks, GEN, model, _api(runtime, tiny_model_dir, path), chat)
    theirs = _samples(tasks, GEN, "hf", _hf(tiny_model_dir), chat)
    assert ours == theirs and any(r[0] for r in ours)
