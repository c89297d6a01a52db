"""Every suite of `radixrt bench`, one module each; importing this package registers them all
(`radixrt.bench.registry`), and `suite_for` looks up the one a config runs."""

from radixrt.bench.config import BenchConfig
from radixrt.bench.registry import SUITES, Suite
from radixrt.bench.suites import (
    agent_tools,
    every,
    families,
    gpu_check,
    grammar,
    http_chat,
    hybrid_prefix,
    kernels,
    kv_cache_dtype,
    logprob_drift,
    lora,
    openai_server,
    programs,
    ray_routing,
    requests,
    serve_defaults,
    served_latency,
    spec_ab,
    steps,
    weight_update,
)

# imported for their registrations
MODULES = (
    agent_tools,
    every,
    families,
    gpu_check,
    grammar,
    http_chat,
    hybrid_prefix,
    kernels,
    kv_cache_dtype,
    logprob_drift,
    lora,
    openai_server,
    programs,
    ray_routing,
    requests,
    serve_defaults,
    served_latency,
    spec_ab,
    steps,
    weight_update,
)


def suite_for(config: BenchConfig) -> Suite:
    """The suite registered under `config.suite_key` (the config's choices allow no other)."""
    return SUITES[config.suite_key]
