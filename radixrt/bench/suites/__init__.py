"""Every suite of `radixrt bench`, one module each; importing this package registers them all
(`radixrt.bench.registry`), and `suite_for` looks up the one a config runs."""

from radixrt.bench.config import BenchConfig
from radixrt.bench.registry import SUITES, Suite
from radixrt.bench.suites import (
    agent_tools,
    every,
    grammar,
    http_chat,
    kernels,
    lora,
    openai_server,
    programs,
    requests,
)

# imported for their registrations
MODULES = (
    agent_tools,
    every,
    grammar,
    http_chat,
    kernels,
    lora,
    openai_server,
    programs,
    requests,
)


def suite_for(config: BenchConfig) -> Suite:
    """The suite registered under `config.suite_key` (the config's choices allow no other)."""
    return SUITES[config.suite_key]
