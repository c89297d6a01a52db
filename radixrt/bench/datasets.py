"""Workloads read from a file: ShareGPT-format conversations (`--workload sharegpt
--dataset-path FILE`), the dataset vLLM's and SGLang's serving benchmarks default to.

A file is a JSON list of conversations, or JSON Lines with one conversation a line; each
conversation is `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value":
...}, ...]}` (other keys, such as "id", are ignored). As in vLLM's benchmark, a request is a
conversation's first human turn sent as a raw prompt, asked for as many tokens as the reply
that followed it had (`--fixed-output-len` asks for `--max-new-tokens` instead), with the EOS
ignored so that the output is that long; conversations with a prompt or reply under
`MIN_TOKENS` are skipped, and the rest are shuffled by `--seed`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from radixrt.bench.workloads import REQUEST_WORKLOADS, Session, Turn, WorkloadConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MIN_TOKENS = 4  # vLLM's filter: shorter prompts or replies say nothing about a server


@dataclass(frozen=True)
class Exchange:
    """A conversation's first human turn and the reply to it."""

    prompt: str
    reply: str


def load_sharegpt(path: str | Path) -> list[Exchange]:
    """Every conversation of the file that opens with a human turn answered by a gpt turn, in
    file order. A file that is neither a JSON list nor JSON Lines of conversations is a
    ValueError naming it."""
    text = Path(path).read_text()
    try:
        records = json.loads(text) if text.lstrip().startswith("[") else _json_lines(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not ShareGPT JSON or JSON Lines ({e})") from None
    exchanges = []
    for record in records:
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"{path}: a record without a 'conversations' list")
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            exchanges.append(Exchange(turns[0]["value"], turns[1]["value"]))
    return exchanges


def _json_lines(text: str) -> list[object]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def sharegpt(tokenizer: PreTrainedTokenizerBase, cfg: WorkloadConfig) -> list[Session]:
    """`cfg.num_requests` exchanges of `cfg.dataset_path` (all of them when it has fewer)."""
    if not cfg.dataset_path:
        raise ValueError("--workload sharegpt reads --dataset-path")
    exchanges = load_sharegpt(cfg.dataset_path)
    random.Random(cfg.seed).shuffle(exchanges)
    sessions = []
    for exchange in exchanges:
        prompt_len = len(tokenizer.encode(exchange.prompt, add_special_tokens=False))
        reply_len = len(tokenizer.encode(exchange.reply, add_special_tokens=False))
        if min(prompt_len, reply_len) < MIN_TOKENS:
            continue
        params = {
            "max_new_tokens": cfg.max_new_tokens if cfg.fixed_output else reply_len,
            "temperature": cfg.temperature,
            "ignore_eos": True,
        }
        sessions.append(Session([Turn(exchange.prompt, params)]))
        if len(sessions) == cfg.num_requests:
            break
    if not sessions:
        raise ValueError(f"{cfg.dataset_path}: no conversation long enough to send")
    return sessions


DATASET_WORKLOADS = {"sharegpt": sharegpt}  # request workloads read from --dataset-path
# every request workload by name: the synthetic ones and those read from a file
ALL_REQUEST_WORKLOADS = {**REQUEST_WORKLOADS, **DATASET_WORKLOADS}
