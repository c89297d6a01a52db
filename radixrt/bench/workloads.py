"""Synthetic workloads shaped like real traffic, generated from a seed (no downloads).

A workload is a list of sessions; a session is a list of turns run one after another by one
client. Chat sessions resend the whole history each turn, rendered with the model's template.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

WORDS = (
    "river stone light cloud paper engine garden window silver market winter signal forest "
    "harbor violet copper lantern meadow thunder canyon orbit velvet glacier ember quartz"
).split()
NAMES = "Ada Bruno Chen Dara Emil Farah Goran Hana Ivo Jun Kofi Lena Mateo Nia Omar Priya".split()
CITIES = "Lisbon Osaka Lagos Quito Oslo Hanoi Perth Cusco Tunis Riga Accra Porto".split()
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "maxDigits": 3},
        "city": {"type": "string", "maxLength": 16},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "member"],
}


@dataclass
class Turn:
    text: str  # raw prompt text, or the user's message in a chat session
    params: dict[str, Any]  # the request's sampling parameters (JSON values)


@dataclass
class Session:
    turns: list[Turn]
    system: str = ""  # chat sessions: the system message
    chat: bool = False
    tag: str = ""


@dataclass
class WorkloadConfig:
    num_requests: int = 64  # sessions (conversations for multi-turn)
    # mean output length; lengths are long-tailed (exponential, 4 to 4x) unless fixed
    max_new_tokens: int = 64
    fixed_output: bool = False
    prefix_tokens: int = 500  # shared system prompt (shared-prefix)
    question_tokens: int = 30
    turns: int = 6  # multi-turn
    long_prompts: int = 4  # long-prompt: how many ~long_tokens prompts among the short requests
    long_tokens: int = 4000
    seed: int = 0
    temperature: float = 0.0  # of every request (0: greedy)
    num_prefixes: int = 8  # multi-prefix: distinct system prompts
    # random: exact prompt and output lengths (vLLM's --random-input-len / --random-output-len)
    random_input_len: int | None = None
    random_output_len: int | None = None
    dataset_path: str | None = None  # sharegpt: the file (radixrt.bench.datasets)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def text_of_tokens(rng: random.Random, tokenizer: PreTrainedTokenizerBase, num_tokens: int) -> str:
    """Random words that tokenize to about `num_tokens` tokens (never fewer)."""
    text = words(rng, max(num_tokens // 2, 1))
    while len(tokenizer.encode(text, add_special_tokens=False)) < num_tokens:
        text += " " + words(
            rng, max((num_tokens - len(tokenizer.encode(text, add_special_tokens=False))) // 2, 1)
        )
    return text


def _new_tokens(rng: random.Random, cfg: WorkloadConfig) -> int:
    if cfg.fixed_output:
        return cfg.max_new_tokens
    return min(max(round(rng.expovariate(1 / cfg.max_new_tokens)), 4), 4 * cfg.max_new_tokens)


def _params(rng: random.Random, cfg: WorkloadConfig) -> dict[str, Any]:
    return {
        "max_new_tokens": _new_tokens(rng, cfg),
        "temperature": cfg.temperature,
        "ignore_eos": True,
    }


def shared_prefix(tokenizer: PreTrainedTokenizerBase, cfg: WorkloadConfig) -> list[Session]:
    """One long system prompt shared by every request, each with its own short question."""
    rng = random.Random(cfg.seed)
    system = "System: you are a helpful assistant. " + text_of_tokens(
        rng, tokenizer, cfg.prefix_tokens
    )
    return [
        Session(
            [
                Turn(
                    f"{system}\nQuestion {i}: {text_of_tokens(rng, tokenizer, cfg.question_tokens)}?\n"
                    "Answer:",
                    _params(rng, cfg),
                )
            ]
        )
        for i in range(cfg.num_requests)
    ]


def multi_prefix(tokenizer: PreTrainedTokenizerBase, cfg: WorkloadConfig) -> list[Session]:
    """`num_prefixes` long system prompts (several apps on one fleet), each request one of them,
    at random, with its own short question: where a request is sent decides whether its
    prefix is cached there."""
    rng = random.Random(cfg.seed)
    systems = [
        f"System {k}: you are assistant number {k}. "
        + text_of_tokens(rng, tokenizer, cfg.prefix_tokens)
        for k in range(cfg.num_prefixes)
    ]
    return [
        Session(
            [
                Turn(
                    f"{rng.choice(systems)}\nQuestion {i}: "
                    f"{text_of_tokens(rng, tokenizer, cfg.question_tokens)}?\nAnswer:",
                    _params(rng, cfg),
                )
            ]
        )
        for i in range(cfg.num_requests)
    ]


def multi_turn(tokenizer: PreTrainedTokenizerBase, cfg: WorkloadConfig) -> list[Session]:
    """Chat conversations that resend their growing history every turn."""
    rng = random.Random(cfg.seed)
    system = "You are a concise assistant for travellers. " + text_of_tokens(rng, tokenizer, 60)
    return [
        Session(
            [
                Turn(
                    f"Turn {t}: tell me about the {words(rng, 3)} of {rng.choice(CITIES)}. "
                    + text_of_tokens(rng, tokenizer, cfg.question_tokens),
                    _params(rng, cfg),
                )
                for t in range(cfg.turns)
            ],
            system=system,
            chat=True,
        )
        for _ in range(cfg.num_requests)
    ]


def long_prompt(tokenizer: PreTrainedTokenizerBase, cfg: WorkloadConfig) -> list[Session]:
    """Short decodes with a few long prompts among them: chunked prefill keeps the short ones' ITL low."""
    rng = random.Random(cfg.seed)
    sessions = [
        Session(
            [
                Turn(
                    f"Note {i}: {text_of_tokens(rng, tokenizer, cfg.question_tokens)}\nSummary:",
                    {**_params(rng, cfg), "max_new_tokens": cfg.max_new_tokens},
                )
            ],
            tag="short",
        )
        for i in range(cfg.num_requests)
    ]
    for j in range(cfg.long_prompts):
        turn = Turn(
            f"Document {j}: {text_of_tokens(rng, tokenizer, cfg.long_tokens)}\nSummary:",
            {"max_new_tokens": 8, "temperature": cfg.temperature, "ignore_eos": True},
        )
        sessions.insert(
            (j + 1) * len(sessions) // (cfg.long_prompts + 1), Session([turn], tag="long")
        )
    return sessions


def random_prompts(tokenizer: PreTrainedTokenizerBase, cfg: WorkloadConfig) -> list[Session]:
    """Nothing shared (the control): prompts of random words and lengths, or of
    `random_input_len` tokens and `random_output_len` new tokens exactly where they are set."""
    rng = random.Random(cfg.seed)
    sessions = []
    for _ in range(cfg.num_requests):
        length = cfg.random_input_len or rng.randint(cfg.question_tokens, 4 * cfg.question_tokens)
        text = text_of_tokens(rng, tokenizer, length)  # before the params: the seeded order
        params = _params(rng, cfg)
        if cfg.random_output_len:
            params["max_new_tokens"] = cfg.random_output_len
        sessions.append(Session([Turn(text, params)]))
    return sessions


def json_records(tokenizer: PreTrainedTokenizerBase, cfg: WorkloadConfig) -> list[Session]:
    """Each request fills a 4-field JSON schema about a different person."""
    rng = random.Random(cfg.seed)
    return [
        Session(
            [
                Turn(
                    f"Describe {rng.choice(NAMES)}, who lives in {rng.choice(CITIES)}, as a JSON record "
                    "with name, age, city and member.",
                    {
                        "max_new_tokens": 96,
                        "temperature": cfg.temperature,
                        "json_schema": PERSON_SCHEMA,
                    },
                )
            ],
            chat=True,
        )
        for _ in range(cfg.num_requests)
    ]


TOOLS = {
    "search": "query",
    "weather": "city",
    "calculate": "expression",
    "translate": "text",
    "lookup": "name",
}


def _tool_call(rng: random.Random) -> str:
    tool = rng.choice(list(TOOLS))
    value = rng.choice(CITIES) if tool == "weather" else words(rng, rng.randint(1, 3))
    return f'{{"tool": "{tool}", "arguments": {{"{TOOLS[tool]}": "{value}"}}}}'


def agent_loop(tokenizer: PreTrainedTokenizerBase, cfg: WorkloadConfig) -> list[Session]:
    """A tool-using agent's next step: the transcript of its earlier steps (thoughts, JSON tool
    calls, observations), resent with each call; the model writes the next steps in their shape."""
    rng = random.Random(cfg.seed)
    header = (
        "You are an agent. Each step: a thought, one tool call as JSON, then its observation.\n"
    )
    header += "".join(f'Tool {t}: takes {{"{a}": string}}.\n' for t, a in TOOLS.items())
    sessions = []
    for i in range(cfg.num_requests):
        steps = "".join(
            f"Step {s}:\nThought: I need the {words(rng, 2)} for task {i}.\n"
            f"Call: {_tool_call(rng)}\nObservation: {words(rng, rng.randint(3, 8))}\n"
            for s in range(1, 5)
        )
        sessions.append(
            Session(
                [Turn(f"{header}Task {i}: {words(rng, 8)}.\n{steps}Step 5:\n", _params(rng, cfg))]
            )
        )
    return sessions


def few_shot(tokenizer: PreTrainedTokenizerBase, cfg: WorkloadConfig) -> list[Session]:
    """Five worked examples of one answer shape, then a new question in the same shape."""
    rng = random.Random(cfg.seed)

    def example(answer: bool) -> str:
        name, city = rng.choice(NAMES), rng.choice(CITIES)
        text = f"Q: {name} moved to {city} to study {words(rng, 2)}. Who, where, what?\n"
        return text + (f"A: who={name}; where={city}; what=study.\n\n" if answer else "A:")

    shots = "".join(example(True) for _ in range(5))
    return [
        Session([Turn(shots + example(False), _params(rng, cfg))]) for _ in range(cfg.num_requests)
    ]


# a workload's sessions, built with the model's tokenizer
Workload: TypeAlias = "Callable[[PreTrainedTokenizerBase, WorkloadConfig], list[Session]]"

REQUEST_WORKLOADS: dict[str, Workload] = {
    "shared-prefix": shared_prefix,
    "multi-prefix": multi_prefix,
    "multi-turn": multi_turn,
    "long-prompt": long_prompt,
    "random": random_prompts,
    "json": json_records,
    "agent-loop": agent_loop,
    "few-shot": few_shot,
}
