"""`--workload grammar`: the two grammar backends side by side, on the model's tokenizer alone
(no weights): each of the bench's constraints compiled cold, then the time to build and apply a
batch's masks per decode step at batch 1 and 64 (p50/p99), every row walking a valid output token
by token. Into `grammar.json` and `grammar-masks.png`. The end-to-end figures (the JSON workload's
req/s and mask share of step time per backend) come from `--workload json` with the
`radixrt-llguidance*` systems."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from tqdm import tqdm

from radixrt.bench.registry import register
from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult
from radixrt.bench.workloads import PERSON_SCHEMA
from radixrt.structured.grammar import GRAMMAR_BACKENDS
from radixrt.structured.regexes import JSON_OBJECT_LARK

BATCHES = (1, 64)
ARITHMETIC_GBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "level": {"type": "integer", "minimum": 1, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["level", "tags"],
}


@dataclass(frozen=True)
class Case:
    """A constraint the bench compiles, and an output it allows, walked for the mask times."""

    name: str
    constraint: dict[str, Any]
    text: str


CASES = (
    Case(
        "person (json workload)",
        {"json_schema": PERSON_SCHEMA},
        '{"name":"Ada Lovelace","age":36,"city":"London","member":true}',
    ),
    Case("bounded schema", {"json_schema": BOUNDED_SCHEMA}, '{"level":7,"tags":["a","bc"]}'),
    Case(
        "json_object",
        {"lark": JSON_OBJECT_LARK},
        '{"a":{"b":[1,2,{"c":"d"}]},"e":null,"f":"long text here"}',
    ),
    Case("arithmetic GBNF", {"ebnf": ARITHMETIC_GBNF}, "(12+3)*45-6/7+(8*(9-10))"),
)


@dataclass(frozen=True)
class MaskTimes:
    """One case under one backend at one batch size, per decode step: the ms to fill the batch's
    mask rows (the backend's share), per row, and to apply them to the logits (the same op for
    both backends)."""

    case: str
    backend: str
    compiled_by: str  # the backend that took it (CFGs and bounds always go to llguidance)
    compile_ms: float
    batch: int
    fill_p50_ms: float
    fill_p99_ms: float
    row_fill_p50_us: float
    apply_p50_ms: float


@register("grammar")
def run_grammar(run: BenchRun) -> dict[str, list[RunResult]]:
    from transformers import AutoTokenizer

    from radixrt.executor.model_loader import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(run.config.model))
    rows = [row for backend in GRAMMAR_BACKENDS for row in _backend_rows(tokenizer, backend)]
    _print(rows)
    run.write("grammar", {"workload": "grammar", "results": [asdict(r) for r in rows]})
    _plot(rows, run)
    return {}


def _backend_rows(tokenizer: Any, backend: str) -> list[MaskTimes]:
    """Every case's compile time and mask times under `backend` (a fresh compiler, warmed on a
    trivial constraint so that one-time setup, llguidance's tokenizer for one, is not counted)."""
    from radixrt.structured.compiler import ConstraintCompiler

    vocab = len(tokenizer)
    compiler = ConstraintCompiler(tokenizer, vocab, backend=backend)
    try:
        compiler.compile(regex="warm")
        compiler.compile(lark='start: "warm"')
        rows = []
        for case in tqdm(CASES, desc=f"grammar backend {backend}"):
            start = time.perf_counter()
            grammar = compiler.compile(**case.constraint)
            compile_ms = 1e3 * (time.perf_counter() - start)
            ids = tokenizer.encode(case.text, add_special_tokens=False) + [compiler.eos_token_id]
            for batch in BATCHES:
                fills, applies = _step_times(grammar, ids, batch, vocab)
                rows.append(
                    MaskTimes(
                        case.name,
                        backend,
                        grammar.backend,
                        compile_ms,
                        batch,
                        1e3 * statistics.median(fills),
                        1e3 * _p99(fills),
                        1e6 * statistics.median(fills) / batch,
                        1e3 * statistics.median(applies),
                    )
                )
        return rows
    finally:
        compiler.close()


def _step_times(
    grammar: Any, ids: list[int], batch: int, vocab: int
) -> tuple[list[float], list[float]]:
    """Seconds per decode step to fill `batch` rows' masks, and to apply them to float32 logits,
    as the output processor does, with every row at the same place in `ids`. On one torch thread:
    filling is single-threaded anyway, and a shared machine's spare cores would make the apply's
    figure noise."""
    import torch

    from radixrt.structured.bitmask import allocate_bitmask, apply_bitmask

    guides = [grammar.guide() for _ in range(batch)]
    bitmask = allocate_bitmask(batch, vocab)
    logits = torch.zeros(batch, vocab)
    fills, applies = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for token in ids:
            start = time.perf_counter()
            for i, guide in enumerate(guides):
                guide.fill_mask(bitmask[i])
            filled = time.perf_counter()
            apply_bitmask(logits, bitmask)
            fills.append(filled - start)
            applies.append(time.perf_counter() - filled)
            for guide in guides:
                guide.advance(token)
    finally:
        torch.set_num_threads(threads)
    return fills, applies


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _print(rows: list[MaskTimes]) -> None:
    print(
        f"{'constraint':24} {'backend':11} {'compiled by':11} {'compile ms':>10} {'batch':>5} "
        f"{'fill p50 ms':>11} {'fill p99 ms':>11} {'row p50 us':>10} {'apply p50 ms':>12}"
    )
    for r in rows:
        print(
            f"{r.case:24} {r.backend:11} {r.compiled_by:11} {r.compile_ms:10.1f} {r.batch:5d} "
            f"{r.fill_p50_ms:11.3f} {r.fill_p99_ms:11.3f} {r.row_fill_p50_us:10.1f} "
            f"{r.apply_p50_ms:12.3f}"
        )


def _plot(rows: list[MaskTimes], run: BenchRun) -> None:
    from radixrt.bench.plots import plot_bars

    at_64 = {f"{r.case} / {r.backend}": r.fill_p50_ms for r in rows if r.batch == BATCHES[-1]}
    path = plot_bars(
        at_64,
        run.out_dir / "grammar-masks.png",
        "ms per decode step",
        f"filling the constraint masks at batch {BATCHES[-1]} (p50)",
    )
    print(f"plot: {path}")
