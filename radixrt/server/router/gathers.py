"""Control ops fanned out to several workers (`stats`, `metrics`, `flush_cache`, a pin, ...):
each worker gets the op under a sub-rid of its own, and the gather is answered once every worker
sent has replied, or been lost, or at its deadline with what arrived."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from radixrt.server.router.prefix_tree import Prompt
from radixrt.server.router.worker import WorkerLink
from radixrt.server.tenants import OPEN, Principal

GATHER_TIMEOUT_S = 30.0  # a fanned-out control op answers with what arrived by then


@dataclass(eq=False)
class Gather:
    """A control op sent to several workers; answered when all replied or at `deadline`."""

    identity: bytes | None  # None: the router asked for itself
    rid: Any
    op: str
    deadline: float
    waiting: set[int] = field(default_factory=set)  # indices of the workers yet to answer
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)
    pin: tuple[str, Prompt] | None = None  # (pin_id, prompt) of a pin op
    viewer: Principal = OPEN  # who asked (a tenant sees its own stats row and no server path)


class Gathers:
    """The gathers in progress, by the sub-rid each of their workers was sent."""

    def __init__(self) -> None:
        self.by_sub: dict[str, tuple[Gather, int]] = {}  # sub-rid -> (gather, worker index)
        self._ids = itertools.count()

    def __bool__(self) -> bool:
        return bool(self.by_sub)

    def send(self, gather: Gather, msg: dict[str, Any], workers: list[WorkerLink]) -> None:
        """Send `msg` to each of `workers` under a fresh sub-rid; those that take it are waited
        for (none: the gather is complete at once)."""
        for w in workers:
            sub = f"gather-{next(self._ids)}"
            if w.send({**msg, "rid": sub}):
                self.by_sub[sub] = (gather, w.index)
                gather.waiting.add(w.index)

    def part(self, rid: str, index: int) -> Gather | None:
        """The gather whose part worker `index` answers with `rid`, if any (another worker's
        sub-rid is not this one's to answer)."""
        gathered = self.by_sub.get(rid)
        return gathered[0] if gathered is not None and gathered[1] == index else None

    def answer(self, rid: str, reply: dict[str, Any]) -> Gather | None:
        """Record `reply` for the part `rid`; the gather when that completed it."""
        gather, index = self.by_sub.pop(rid)
        gather.replies[index] = reply
        gather.waiting.discard(index)
        return None if gather.waiting else gather

    def drop_worker(self, index: int) -> list[Gather]:
        """Stop waiting for worker `index`; the gathers that completes."""
        done = []
        for sub, (gather, i) in list(self.by_sub.items()):
            if i == index:
                del self.by_sub[sub]
                gather.waiting.discard(i)
                if not gather.waiting:
                    done.append(gather)
        return done

    def expired(self, now: float) -> list[Gather]:
        """The gathers past their deadline (each once)."""
        return list({id(g): g for g, _ in self.by_sub.values() if now > g.deadline}.values())

    def all(self) -> list[Gather]:
        return list({id(g): g for g, _ in self.by_sub.values()}.values())

    def close(self, gather: Gather) -> None:
        """Forget `gather`'s parts still out: a late reply to one is dropped."""
        for sub in [s for s, (g, _) in self.by_sub.items() if g is gather]:
            del self.by_sub[sub]
        gather.waiting.clear()
