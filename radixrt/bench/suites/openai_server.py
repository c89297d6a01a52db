"""`--backend openai --base-url URL`: a request workload against any OpenAI-compatible server
(`radixrt.bench.openai_target`), under each load of the run, into `<workload>.json` with
vLLM's flat keys. The bench starts nothing: the server is whatever answers at the URL."""

from __future__ import annotations

import functools

from radixrt.bench.datasets import ALL_REQUEST_WORKLOADS
from radixrt.bench.load import run_load
from radixrt.bench.openai_target import OpenAITarget, openai_base_url
from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult, result_of
from radixrt.server.http.schemas import render_chat


@register("openai")
def run_openai_server(run: BenchRun) -> dict[str, list[RunResult]]:
    """The workload's sessions, built with `--model`'s tokenizer (the served model's, for exact
    lengths), sent to `--base-url` under each load."""
    from transformers import AutoTokenizer

    from radixrt.executor.model_loader import resolve_model_path

    config = run.config
    assert config.base_url is not None  # the config refuses --backend openai without it
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model))
    make = ALL_REQUEST_WORKLOADS[config.workload]
    sessions = make(tokenizer, config.shape)
    target = OpenAITarget(config.base_url, config.served_model_name)
    system = openai_base_url(config.base_url)
    render = functools.partial(render_chat, tokenizer)
    results = []
    for load in config.loads:
        traces, duration = run_load(target, sessions, load, render, desc=system)
        results.append(result_of(system, load, traces, duration, config.slo))
    run.report(config.workload, [system], results)
    return {config.workload: results}
