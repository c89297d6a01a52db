"""`radixrt bench --backend http --workload agent-tools`: agents that call tools over the OpenAI
API, each mode of `tool_choice` against an unconstrained run of the same agents.

Each agent asks about a city, then for `turns` turns asks the model for a call, runs the named
Python function and sends the result back as a `tool` message (the whole history resent, so all
but the newest messages should come from the radix cache); a last turn answers (`none`). The
modes: `required`, a named function, `auto` (all constrained), and `unconstrained`: the same
prompts under `tool_choice: none`, the reply read afterwards with the same parser, which is how a
server without constraints fares (its calls read leniently, as peers' Hermes parsers do:
whitespace and key order free). Per mode: the share of calls that parse and validate against
their tool's schema, the share of turns that called, the cache hit rate of the turns after the
first, and the time per tool-call turn.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jsonschema
from tqdm import tqdm

from radixrt.bench.load import REPLY_TIMEOUT_S
from radixrt.bench.metrics import percentile
from radixrt.client.launcher import Runtime
from radixrt.structured.tools import ToolCall

CITIES = ("Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Perth", "Accra", "Riga")
TOOLS: list[dict[str, Any]] = [  # the OpenAI API's tool objects (JSON)
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 32},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_population",
            "description": "How many people live in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 32}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SYSTEM = "You are a travel assistant. Use the tools to answer; answer in one sentence."
MODES = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
    "auto": "auto",
    "unconstrained": "none",
}


@dataclass
class ToolBenchConfig:
    model: str = "default"
    num_agents: int = 8
    turns: int = 3  # tool-call turns per agent, then one answer
    max_new_tokens: int = 64
    max_total_tokens: int | None = 65536
    temperature: float = 0.0
    seed: int = 0
    # one call per tool-call turn (a small model asked for "one or more" repeats itself until
    # max_tokens), so a turn's time is one call's
    parallel_tool_calls: bool = False


@dataclass
class TurnRecord:
    index: int  # the turn's place in its conversation
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    calls: int  # calls the reply made
    valid_calls: int  # of them, those that parse and validate


@dataclass
class ModeResult:
    mode: str
    call_turns: int
    turns_that_called: float  # share of tool-call turns with at least one call
    calls: int
    parse_valid: float | None  # share of calls that parse and validate (None: no calls)
    later_turns_cache_hit_rate: float  # cached / prompt tokens over the turns after the first
    turn_s_mean: float  # per tool-call turn
    turn_s_p50: float
    completion_tokens_per_turn: float


def run_tool_bench(config: ToolBenchConfig) -> dict[str, Any]:
    """Every mode on one runtime (cache flushed before each); prints a table and returns
    `{"config", "modes": [ModeResult...], "turn_time_over_unconstrained"}`."""
    import openai

    runtime = Runtime(
        model=config.model,
        max_total_tokens=config.max_total_tokens,
        log_level="warning",
        timeout=REPLY_TIMEOUT_S,
    )
    with runtime:
        client = openai.OpenAI(
            base_url=f"{runtime.http_url}/v1", api_key="none", timeout=REPLY_TIMEOUT_S
        )
        for mode in MODES:  # compile each constraint before any timing
            _agent(client, config, mode, CITIES[0], warm_up=True)
        runs: dict[str, list[list[TurnRecord]]] = {mode: [] for mode in MODES}
        # two rounds, the second in reverse order, so a machine load that drifts over the run
        # weighs on every mode alike
        for order in (list(MODES), list(reversed(MODES))):
            for mode in order:
                runtime.flush_cache()
                runs[mode] += _run_agents(client, config, mode, len(runs[mode]))
    results = [_summary(mode, records, config) for mode, records in runs.items()]
    unconstrained = next(r for r in results if r.mode == "unconstrained").turn_s_mean
    ratios = {r.mode: r.turn_s_mean / unconstrained for r in results if r.mode != "unconstrained"}
    _print_table(results, ratios)
    return {
        "config": dataclasses.asdict(config),
        "modes": [dataclasses.asdict(r) for r in results],
        "turn_time_over_unconstrained": ratios,
    }


def _run_agents(
    client: Any, config: ToolBenchConfig, mode: str, first: int
) -> list[list[TurnRecord]]:
    """Half the agents (from number `first` on), all at once, one thread each."""
    count = (config.num_agents + 1) // 2 if first == 0 else config.num_agents // 2
    cities = [CITIES[(config.seed + first + i) % len(CITIES)] for i in range(count)]
    with ThreadPoolExecutor(max_workers=max(count, 1)) as pool:
        return list(
            tqdm(
                pool.map(lambda city: _agent(client, config, mode, city), cities),
                total=count,
                desc=f"agents, {mode}",
            )
        )


def _summary(mode: str, runs: list[list[TurnRecord]], config: ToolBenchConfig) -> ModeResult:
    turns = [t for run in runs for t in run if t.index < config.turns]
    later = [t for run in runs for t in run if t.index > 0]
    calls = sum(t.calls for t in turns)
    seconds = [t.seconds for t in turns]
    return ModeResult(
        mode,
        len(turns),
        sum(t.calls > 0 for t in turns) / max(len(turns), 1),
        calls,
        sum(t.valid_calls for t in turns) / calls if calls else None,
        sum(t.cached_tokens for t in later) / max(sum(t.prompt_tokens for t in later), 1),
        sum(seconds) / max(len(seconds), 1),
        percentile(seconds, 50),
        sum(t.completion_tokens for t in turns) / max(len(turns), 1),
    )


def _agent(
    client: Any, config: ToolBenchConfig, mode: str, city: str, warm_up: bool = False
) -> list[TurnRecord]:
    """One agent's conversation: `turns` tool-call turns, then an answer, through `client`, an
    `openai.OpenAI` (Any: its message and tool parameters are TypedDicts, the bench's the JSON
    maps the gateway reads)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"I am flying to {city}. What is the weather there?"},
    ]
    records = []
    for index in range(1 if warm_up else config.turns + 1):
        choice = MODES[mode] if index < config.turns else "none"
        start = time.monotonic()
        out = client.chat.completions.create(
            model="default",
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=config.parallel_tool_calls,
            max_tokens=config.max_new_tokens,
            temperature=config.temperature,
            seed=config.seed,
        )
        seconds = time.monotonic() - start
        message = out.choices[0].message
        calls = [
            ToolCall(c.function.name, c.function.arguments, c.id) for c in message.tool_calls or []
        ]
        if mode == "unconstrained" and index < config.turns:
            calls = _lenient_calls(message.content or "")
        valid = [c for c in calls if _valid(c)]
        usage = out.usage
        records.append(
            TurnRecord(
                index,
                seconds,
                usage.prompt_tokens,
                usage.prompt_tokens_details.cached_tokens,
                usage.completion_tokens,
                len(calls),
                len(valid),
            )
        )
        _continue(messages, message.content, valid, index)
    return records


def _continue(
    messages: list[dict[str, Any]], content: str | None, calls: list[ToolCall], index: int
) -> None:
    """The reply and what answers it: each valid call's result as a `tool` message, or (no call)
    the text and a nudge to use a tool."""
    if not calls:
        messages.append({"role": "assistant", "content": content or ""})
        messages.append({"role": "user", "content": "Please use a tool."})
        return
    messages.append(
        {"role": "assistant", "content": None, "tool_calls": [c.to_openai() for c in calls]}
    )
    for call in calls:
        arguments = json.loads(call.arguments)
        result = {"tool": call.name, "turn": index, "result": 21 + len(json.dumps(arguments)) % 9}
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})


def _lenient_calls(text: str) -> list[ToolCall]:
    """Calls in unconstrained text, read as peers' Hermes parsers do: each
    `<tool_call>...</tool_call>` whose inside is a JSON object with a name and arguments."""
    calls = []
    for inside in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        try:
            call = json.loads(inside)
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = json.dumps(call.get("arguments"), separators=(",", ":"))
            calls.append(ToolCall(call["name"], arguments))
    return calls


def _valid(call: ToolCall) -> bool:
    try:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False
    return True


def _print_table(results: list[ModeResult], ratios: dict[str, float]) -> None:
    print(
        f"{'mode':<14} {'turns':>6} {'called':>7} {'calls':>6} {'parse+valid':>12} "
        f"{'hit rate':>9} {'turn mean':>10} {'p50':>7} {'tok/turn':>9} {'vs unconstr.':>13}"
    )
    for r in results:
        ratio = f"{ratios[r.mode]:.2f}x" if r.mode in ratios else "-"
        valid = "-" if r.parse_valid is None else f"{r.parse_valid:.0%}"
        print(
            f"{r.mode:<14} {r.call_turns:>6} {r.turns_that_called:>7.0%} {r.calls:>6} "
            f"{valid:>12} {r.later_turns_cache_hit_rate:>9.0%} "
            f"{r.turn_s_mean:>9.2f}s {r.turn_s_p50:>6.2f}s {r.completion_tokens_per_turn:>9.1f} "
            f"{ratio:>13}"
        )
