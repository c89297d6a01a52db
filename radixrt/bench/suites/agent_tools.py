"""`--workload agent-tools --backend http`: tool-calling agents per `tool_choice` against an
unconstrained run (`radixrt.bench.tool_bench`), into `agent-tools.json`."""

from __future__ import annotations

from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult
from radixrt.bench.tool_bench import ToolBenchConfig, run_tool_bench


@register("agent-tools")
def run_agent_tools(run: BenchRun) -> dict[str, list[RunResult]]:
    """`--num-requests` agents (8 when unset), `--turns` tool-call turns each."""
    config = run.config
    agents = ToolBenchConfig(
        model=config.model,
        num_agents=config.num_requests or ToolBenchConfig.num_agents,
        turns=config.turns,
        max_new_tokens=config.new_tokens,
        max_total_tokens=config.max_total_tokens,
        temperature=config.temperature,
        seed=config.seed,
    )
    run.write("agent-tools", {"workload": "agent-tools", **run_tool_bench(agents)})
    return {}
