"""What one step computes: running requests' tokens, retraction when the pool is short,
priority preemption, and admission of waiting requests, as a typed `StepPlan`.

The planner needs no model: it works on the request queues, a `KVSlotManager`, the admission
budget and the ranking (tests/engine/test_planner.py drives it over a pool on the CPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from radixrt.config import SchedulerArgs
from radixrt.engine.budget import AdmissionBudget
from radixrt.engine.request import FinishReason, Req, Scheduled
from radixrt.engine.schedule_policy import (
    Ranking,
    match_key,
    order_waiting,
    pick_victim,
    preemption_victim,
)
from radixrt.engine.speculation import Speculation
from radixrt.engine.stats import Counters, StepLog
from radixrt.engine.tenant_stats import TenantStats
from radixrt.mem_cache.slot_manager import KVSlotManager
from radixrt.protocol import ErrorCode

logger = logging.getLogger(__name__)

# defer a request sharing this many new tokens with one admitted this step
IN_BATCH_SHARE_TOKENS = 16


@dataclass
class StepPlan:
    """One step's schedule, filled in as it is made (so a failure part way through still shows
    what was handed out): `items` is what the forward computes, in batch order."""

    items: list[Scheduled] = field(default_factory=list)
    admitted: list[Scheduled] = field(default_factory=list)  # of items, newly admitted
    retracted: list[Req] = field(default_factory=list)  # sent back to wait: the pool was short
    preempted: list[Req] = field(default_factory=list)  # sent back to wait for a higher rank
    # the step's requests -> the KV length their slots reach (what a failure must free)
    allocated: dict[Req, int] = field(default_factory=dict)
    admitting: Req | None = None  # the waiting request admission is looking at


@dataclass(frozen=True)
class PlannerHooks:
    """The planner's calls out: `ready` (a request's constraint has compiled; it may end the
    request), `finish` (end a request now), `make_room` (release pins held past their owners'
    shares until this many slots can be had; whether they can: `PinBook.make_room`)."""

    ready: Callable[[Req], bool]
    finish: Callable[[Req], None]
    make_room: Callable[[int], bool]


@dataclass(frozen=True)
class Accounts:
    """Where the planner counts: the scheduler's counters, per-tenant counters and log."""

    counters: Counters
    tenants: TenantStats
    log: StepLog


class StepPlanner:
    """Makes each step's plan over the scheduler's `waiting` and `running` lists (the same list
    objects: the planner moves requests between them)."""

    def __init__(
        self,
        args: SchedulerArgs,
        kv: KVSlotManager,
        waiting: list[Req],
        running: list[Req],
        accounts: Accounts,
        spec: Speculation | None,
        hooks: PlannerHooks,
    ):
        self.args = args
        self.kv = kv
        self.waiting, self.running = waiting, running
        self.counters, self.tenants, self.log = accounts.counters, accounts.tenants, accounts.log
        self.spec = spec
        self.hooks = hooks
        self.budget = AdmissionBudget(args.chunked_prefill_size, args.max_prefill_tokens)
        self.ranking = Ranking(args.schedule_low_priority_values_first, args.priority_aging_s)

    def schedule(self, plan: StepPlan) -> StepPlan:
        """Fill `plan`: priority preemption (if on), the running requests' tokens (with drafts),
        their slots, then admission under what is left."""
        if self.args.enable_priority_preemption:
            self._preempt_for_priority(plan)
        self.budget.decay()
        left = self.budget.step_tokens()
        items = []
        for req in self.running:
            if req.tokens_to_compute == 1:
                items.append(Scheduled(req, 1))
                continue
            n = self.budget.chunk(req.tokens_to_compute, left)
            if req.snapshot_at > req.kv_len:  # a chunk ends where its state is kept
                n = min(n, req.snapshot_at - req.kv_len)
            if n:
                items.append(Scheduled(req, n))
                left -= n
        if self.spec is not None:
            items = self.spec.add_drafts(items)
        plan.items = self._allocate_running(items, plan)
        if self.args.schedule_mode == "static":
            if not self.running:  # the whole next batch boards at once, its prompts chunked
                self._admit(plan, left=1 << 62, busy=False, defer_shared=False)
        elif not plan.retracted:  # memory is tight right after a retraction
            self._admit(plan, left, bool(plan.items))
        return plan

    def _slots_needed(self, items: list[Scheduled]) -> int:
        return sum(self.kv.slots_needed(s.req, s.n) for s in items)

    def _allocate_running(self, items: list[Scheduled], plan: StepPlan) -> list[Scheduled]:
        """Give every running request slots for its step, evicting then retracting if short;
        drafts are dropped before anything is retracted."""
        if self._slots_needed(items) > self.kv.available():
            items = [Scheduled(s.req, s.n - len(s.draft)) for s in items]
        while not self.hooks.make_room(self._slots_needed(items)):
            victim = pick_victim([s.req for s in items], self.ranking)
            if victim is None:
                break
            self._retract(victim)
            plan.retracted.append(victim)
            items = [s for s in items if s.req is not victim]
        kept = []
        for item in items:
            if self.kv.extend(item.req, item.n):
                plan.allocated[item.req] = item.req.kv_len + item.n
                kept.append(item)
            else:  # a lone request larger than the whole pool
                item.req.finish_reason = FinishReason.abort("the KV pool cannot hold this request")
                self.hooks.finish(item.req)
        return kept

    def _retract(self, req: Req) -> None:
        """Take a running request's slots back (its computed pages stay in the tree; with swap
        preemption they are backed up to the host too) and queue it first: it is recomputed
        later, mostly from its own cached prefix, or loaded back from the host."""
        self.kv.retract(req)
        self.running.remove(req)
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.budget.reset()
        self.waiting.insert(0, req)
        logger.info(
            "retracted request %s after %d tokens (pool full); it will be %s",
            req.rid,
            len(req.output_ids),
            "loaded back from the host" if self.kv.swap else "recomputed",
        )

    def _preempt_for_priority(self, plan: StepPlan) -> None:
        """While the best-ranked waiting request could not be admitted for lack of room (or of a
        running slot), retract the lowest-ranked running request ranked below it."""
        if not self.waiting or not self.running:
            return
        now = time.monotonic()
        head = max(self.waiting, key=lambda r: self.ranking.rank(r, now))
        if not self.hooks.ready(head):
            return
        rank = self.ranking.rank(head, now)
        while not self._could_admit(head):
            victim = preemption_victim(self.running, rank, self.ranking, now)
            if victim is None:
                return
            self._retract(victim)
            plan.preempted.append(victim)
            self.counters.priority_preemptions += 1

    def _could_admit(self, req: Req) -> bool:
        """Whether `_admit` would find room for the request's first chunk and what it will need
        later, next to what running requests will need."""
        if len(self.running) >= self.args.max_running_requests or self.kv.free_rows() == 0:
            return False
        extend = len(req.all_ids) - self.kv.peek_prefix(match_key(req), req.cache_salt).length
        n = self.budget.chunk(extend, self.budget.step_tokens()) or extend
        future = self.budget.expected(extend - n, req.remaining_new_tokens())
        return self.kv.available() - self._reserved_tokens() >= n + future

    def _reserved_tokens(self) -> float:
        return sum(
            self.budget.expected(r.tokens_to_compute - 1, r.remaining_new_tokens())
            for r in self.running
        )

    def _admit(self, plan: StepPlan, left: int, busy: bool, defer_shared: bool = True) -> None:
        """Admit waiting requests in policy order while the step's prompt tokens (`left`), the
        running-request limit and the pool's room (less what running requests will need) allow."""
        if not self.waiting:
            return
        reserved = self._reserved_tokens()
        shared_keys: set[tuple[int, ...]] = set()
        policy, ranking = self.args.schedule_policy, self.ranking
        for req in order_waiting(policy, self.waiting, self.kv, ranking):
            if len(self.running) >= self.args.max_running_requests or left <= 0:
                break
            plan.admitting = req
            if not self.hooks.ready(req) or not self._adapter_fits(req):
                continue
            if self.kv.free_rows() == 0:
                break
            match = self.kv.match_prefix(match_key(req), req.cache_salt)
            m = match.length
            if defer_shared and self.kv.sharing and len(req.all_ids) - m > IN_BATCH_SHARE_TOKENS:
                key = tuple(req.all_ids[m : m + IN_BATCH_SHARE_TOKENS])
                if key in shared_keys:
                    continue  # prefilled next step, on top of what this step caches
                shared_keys.add(key)
            self.kv.lock(match.end_node)  # from here the matched prefix is not evictable room
            device = self.kv.load_back(match)  # the host part onto the device, lock moved
            m = len(device.slots)
            extend = len(req.all_ids) - m
            n = self.budget.chunk(extend, left)
            if n == 0:
                if busy or plan.admitted:
                    self.kv.unlock(device.node)
                    break
                n = extend  # an unchunked prompt over the budget runs alone
            req.snapshot_at = self.kv.snapshot_point(req, m, device.unresumable)
            if req.snapshot_at:  # a recurrent model: a chunk ends where its state is kept
                n = min(n, req.snapshot_at - m)
            future = self.budget.expected(extend - n, req.remaining_new_tokens())
            if (self.running or plan.admitted) and self.kv.available() - reserved < n + future:
                self.kv.unlock(device.node)
                break
            self.kv.record_hit(device.node)
            if not self.kv.admit(req, device, n):
                if not (self.running or plan.admitted):
                    self._unblock(req, n)
                break
            plan.allocated[req] = req.kv_len + n
            self._count_admission(req, m, m - len(match.slots), match.storage_tokens)
            self.waiting.remove(req)
            self.running.append(req)
            plan.admitted.append(Scheduled(req, n))
            plan.items.append(Scheduled(req, n))
            left -= n
            reserved += future
        if plan.admitted:
            self.log.prefill(plan.admitted, len(self.running), len(self.waiting))

    def _unblock(self, req: Req, n: int) -> None:
        """Nothing runs, so nothing but pins holds the room `req`'s first `n` tokens lack:
        release pins held past their owners' shares until they fit (it is admitted next
        step), else refuse it with `overloaded` rather than leave it waiting on pins that
        may never go."""
        need = n + self.kv.page_size  # its first page may be partly the matched prefix's
        if self.hooks.make_room(need):
            return
        req.finish_reason = FinishReason.abort(
            f"pins hold the KV pool's room: this request needs {need} slots, {self.kv.available()} "
            f"can be had, and {len(self.kv.pins)} pins within their tenants' shares hold the "
            "rest (--max-pinned-fraction); retry after pins are released",
            ErrorCode.OVERLOADED,
        )
        self.hooks.finish(req)

    def _adapter_fits(self, req: Req) -> bool:
        """Whether the batch can take `req`'s adapter: the base, an adapter already running, or
        a new one while fewer than `--max-loras-per-batch` run (every running request is in
        every step, so the running adapters are the batch's)."""
        name = req.scope.lora_path
        if not name:
            return True
        running = {r.scope.lora_path for r in self.running if r.scope.lora_path}
        return name in running or len(running) < self.args.max_loras_per_batch

    def _count_admission(self, req: Req, cached: int, loaded: int, from_storage: int) -> None:
        """Cache-hit accounting, once per request (a retracted one is admitted again: what it
        loads back then counts as swapped in). `cached` tokens were not recomputed; `loaded` of
        them came from the host tier, which had just read `from_storage` from the disk tier
        (all of them when they were loaded at all)."""
        c = self.counters
        from_storage = from_storage if loaded else 0
        if req.admitted_at is not None:
            c.swapped_in_tokens += loaded
            return
        req.admitted_at = time.monotonic()
        req.cached_tokens = min(cached, len(req.input_ids))
        self.tenants.of(req.scope.tenant).admitted(len(req.input_ids), req.cached_tokens)
        req.host_cached_tokens = loaded - from_storage
        req.storage_cached_tokens = from_storage
        c.prompt_tokens_total += len(req.input_ids)
        c.cached_tokens_total += req.cached_tokens
        c.image_tokens_total += req.image_tokens(len(req.input_ids))
        c.cached_image_tokens_total += req.image_tokens(req.cached_tokens)
        c.host_hit_tokens += loaded - from_storage
        c.storage_hit_tokens += from_storage
