"""The suites of `radixrt bench`, by the key `BenchConfig.suite_key` names (a `--workload`, or
"http" for `--backend http`). A suite module registers its function under its keys when it is
imported; `radixrt.bench.suites` imports them all and looks one up."""

from __future__ import annotations

from collections.abc import Callable

from radixrt.bench.report import BenchRun
from radixrt.bench.results import RunResult

# runs the suite and writes its results; returns them per workload ({} for the HTTP suites,
# whose results are not `RunResult`s)
Suite = Callable[[BenchRun], dict[str, list[RunResult]]]

SUITES: dict[str, Suite] = {}


def register(*keys: str) -> Callable[[Suite], Suite]:
    """Register the decorated suite under each of `keys`; a key registered twice is an error."""

    def add(suite: Suite) -> Suite:
        for key in keys:
            if key in SUITES:
                raise ValueError(f"two suites under {key!r}")
            SUITES[key] = suite
        return suite

    return add
