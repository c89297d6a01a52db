"""Cache-aware continuous batching over the paged pool and the radix cache.

Each step runs one forward over a ragged batch: one token for every decoding request, a chunk
for every request still prefilling, and chunks of newly admitted requests under the step's
token budget. Requests join and leave at every step.

The scheduler wires parts that each have one job: `StepPlanner` (what a step computes:
admission, retraction, priority preemption), `OutputProcessor` (sampling, stops, logprobs,
masks, detokenizing), `Speculation` (drafts; None when off), `Constraints` (compiling and
starting constraints), `Counters` and `scheduler_stats` (the `stats` op), and the
`KVSlotManager`, the one door to KV memory. It keeps requests in and out, `step()` and its
fault containment.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import save_file

from radixrt.config import CacheSettings, SchedulerArgs, ServerArgs
from radixrt.engine.constraints import Constraints
from radixrt.engine.detokenizer import IncrementalDetokenizer
from radixrt.engine.images import ImageSpan, place_images
from radixrt.engine.output_processor import OutputProcessor, RequestEnds
from radixrt.engine.pins import PinBook, PinLimits
from radixrt.engine.planner import Accounts, PlannerHooks, StepPlan, StepPlanner
from radixrt.engine.request import (
    DEFAULT_SCOPE,
    FinishReason,
    Req,
    RequestScope,
    Scheduled,
    adapter_of_salt,
    salt_is_private,
)
from radixrt.engine.speculation import SpecCounters, Speculation, decodes_only
from radixrt.engine.stats import Counters, StatsInputs, StepLog, scheduler_stats
from radixrt.engine.stop_strings import StopAutomaton, StopRegexes, StopScanner
from radixrt.engine.tenant_stats import TenantStats
from radixrt.executor.lora_manager import AdapterError, AdapterInfo
from radixrt.executor.model_loader import model_fingerprint
from radixrt.executor.model_runner import ModelRunner, WeightCounts
from radixrt.executor.tp_worker import TPDriver
from radixrt.executor.weight_update import TensorSpec
from radixrt.forward_batch import ForwardBatch, ImagePart
from radixrt.mem_cache.slot_manager import KVSlotManager
from radixrt.mem_cache.tiers import DevicePool, build_slot_manager
from radixrt.multimodal.images import DecodedImage
from radixrt.protocol import ErrorCode, RequestError, internal_error_text, tensor_handoff_dir
from radixrt.sampling_params import SamplingParams, generation_defaults

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # idle, rank 0 tells the other tensor-parallel ranks it is alive this often
INITIAL_WEIGHT_VERSION = "0"  # the weights loaded at start; each update makes its own
# `pause_generation` modes (SGLang's names): `abort` ends what is in flight (each request
# answers with what it has, finish reason `abort`); `in_place` stops stepping and keeps every
# request with its KV, to go on at `continue_generation`
PAUSE_MODES = ("abort", "in_place")


@dataclass(frozen=True)
class WeightsGroupSpec:
    """Where a trainer's group meets (`init_weights_update_group`) and this runtime's place."""

    name: str
    address: str
    port: int
    rank: int
    world_size: int


@dataclass(frozen=True)
class WeightUpdate:
    """What an update answers: the version now served, and the seconds the load took."""

    weight_version: str
    seconds: float


@dataclass(frozen=True)
class KVCapacity:
    """The KV pool as sized at start: what it stores (`--kv-cache-dtype`, `auto` resolved to
    the model's dtype), the tokens it holds (SGLang's `max_total_num_tokens`) and the bytes a
    token takes in it (every layer's K and V, quantized rows' scales included), which the host
    and disk tiers move too."""

    kv_cache_dtype: str
    max_total_num_tokens: int
    kv_bytes_per_token: int


class ModelInfo(NamedTuple):
    """What the `model_info` op tells about the model served."""

    model_path: Path
    tokenizer_path: Path
    context_length: int
    eos_token_ids: list[int]
    vocab_size: int
    weights: WeightCounts
    sampling_defaults: dict[str, Any]  # from generation_config.json (docs/protocol.md)
    cpu_isa: str | None  # the CPU kernels' path (`--cpu-isa` resolved); None on CUDA
    embedding: dict[str, Any] | None  # `--is-embedding`: the pooling (`Pooling.info`)
    kv: KVCapacity
    quantization: str  # what the linears run as: float, --quantization, or the checkpoint's own
    quantization_reason: str  # why (`quant_choice`): what --quantization auto weighed


class Scheduler:
    """The batching loop's state: waiting and running requests and the parts that act on them;
    `step()` runs one forward. It owns the driver it is given (`driver.runner`: the model, its
    pools and tokenizer; every forward and logits call goes through the driver, which sends it to
    the other tensor-parallel ranks first)."""

    def __init__(self, args: SchedulerArgs, driver: TPDriver):
        self.args = args
        self.driver = driver
        self.runner = runner = driver.runner
        self.tokenizer = runner.tokenizer
        self.sampling_defaults = _sampling_defaults(args, runner.generation_config)
        self.kv = build_slot_manager(
            DevicePool(
                runner.allocator, runner.req_to_token_pool, runner.kv_pool, runner.state_pool
            ),
            _cache_settings(args, runner),
            lambda: model_fingerprint(runner.model_path, runner.dtype, runner.kv_numerics),
            adapter_of_salt,
            salt_is_private,
        )
        self.counters = Counters()
        self.tenants = TenantStats()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self._seeds = torch.Generator().manual_seed(args.random_seed)
        self._ended: list[Req] = []  # finished outside a forward (aborts), reported by step()
        self._plan = StepPlan()  # this step's (what a failure must free)
        self.stalled = False
        self._last_stops: tuple[SamplingParams, StopAutomaton] | None = None  # see _stop_scanner
        self.spec = Speculation.from_args(args, runner.context_length)
        self.constraints = Constraints(
            self.tokenizer,
            runner.vocab_size,
            args.constraint_compile_timeout,
            args.constraint_compiles_per_tenant,
            args.grammar_backend,
            args.enable_jump_forward,
            self._finish,
            reasoning_parser=args.reasoning_parser,
            stop_ids=frozenset(runner.eos_token_ids),
        )
        self.log = StepLog(self.counters, self.kv, args.log_interval)
        self.pins = PinBook(
            self.kv,
            PinLimits.of(
                self.kv.total_tokens,
                args.max_pinned_fraction,
                args.max_pinned_tokens_per_client,
                args.max_pins_per_tenant,
            ),
        )
        self.planner = StepPlanner(
            args,
            self.kv,
            self.waiting,
            self.running,
            Accounts(self.counters, self.tenants, self.log),
            self.spec,
            PlannerHooks(self._ready, self._finish, self.pins.make_room),
        )
        self.output = OutputProcessor(
            driver,
            self.kv,
            self.counters,
            self.constraints,
            self.spec,
            RequestEnds(self._finish, self._fail, self._guard),
        )
        self._last_heartbeat = time.monotonic()
        self.weight_version = INITIAL_WEIGHT_VERSION
        self.weight_updates = 0
        self.paused: str | None = None  # a `PAUSE_MODES` mode until `continue_generation`
        self.holding = False  # an update waits: requests not yet started stay queued
        self.kv_released = False  # `release_memory_occupation` until `resume_memory_occupation`

    def close(self) -> None:
        """Finish what runs in the background (the disk tier's writes), kill the constraint
        compiler's workers, and stop the model's other tensor-parallel ranks."""
        self.kv.close()
        self.constraints.close()
        self.driver.close()

    def idle(self) -> None:
        """Called while there is no work: every second, a heartbeat to the other ranks (a dead
        rank raises here); the constraint compiler stops its idle workers."""
        self.constraints.poll()
        self.kv.end_event_batch()
        now = time.monotonic()
        if now - self._last_heartbeat >= HEARTBEAT_S:
            self._last_heartbeat = now
            self.driver.heartbeat()

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> Scheduler:
        """A scheduler over a new model (and its ranks), each given its part of `args`."""
        return cls(args.scheduler, TPDriver.start(args.executor))

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks of the model (above 1 a failed step must end the process)."""
        return self.runner.tp.size

    def model_info(self) -> ModelInfo:
        r = self.runner
        eos = sorted(r.eos_token_ids)
        return ModelInfo(
            r.model_path,
            r.tokenizer_path,
            r.context_length,
            eos,
            r.vocab_size,
            r.weights,
            self.sampling_defaults,
            r.cpu_isa.value if r.cpu_isa else None,
            r.pooling.info() if r.pooling else None,
            KVCapacity(
                r.kv_pool.fmt.value if r.kv_pool.fmt else str(r.dtype).removeprefix("torch."),
                self.kv.total_tokens,
                r.kv_pool.bytes_per_token,
            ),
            r.quantization_path,
            r.quant.reason,
        )

    # ---- requests in and out ---------------------------------------------------------------
    def make_request(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        sample_index: int = 0,
        scope: RequestScope = DEFAULT_SCOPE,
        images: Sequence[DecodedImage] = (),
    ) -> Req:
        """A request for `input_ids`, checked against the vocabulary, the context and the pool
        (ValueError, `context_length_exceeded`); its constraint starts compiling. `images`, in
        prompt order, decoded and checked by the caller (`multimodal.images.load_image`, off
        the serving loop), go where `input_ids` holds the model's image token: one per image,
        or each image's run already expanded (`place_images`); ValueError for images to a
        model without a vision tower, or placeholders that do not match them."""
        r = self.runner
        input_ids, spans = self._place_images(input_ids, images)
        check_prompt(input_ids, params, r.vocab_size, r.context_length, self.kv.total_tokens)
        check_prompt_logprobs(input_ids, params, self.args.max_prompt_logprob_entries)
        if r.pooling is not None and params.max_new_tokens != 0:
            raise ValueError(
                "this server embeds (--is-embedding) and generates nothing: send max_new_tokens 0 "
                "(or POST /v1/embeddings)"
            )
        scope = self.with_adapter(scope)
        seed = (
            params.seed + sample_index
            if params.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        )
        req = Req(
            rid,
            list(input_ids),
            params,
            IncrementalDetokenizer(
                self.tokenizer,
                input_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            ),
            torch.Generator().manual_seed(seed),
            scope=scope,
            images=spans,
            stops=self._stop_scanner(params),
            stop_regexes=StopRegexes(params.stop_regex) if params.stop_regex else None,
            pooling=r.pooling,
        )
        if self.spec is not None:
            self.spec.start(req)
        self.constraints.start(req, params)
        return req

    def _place_images(
        self, input_ids: list[int], images: Sequence[DecodedImage]
    ) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """The prompt with its images' placeholders expanded, and their spans (none for a
        model without a vision tower, which is refused any image)."""
        features = self.runner.image_features
        if features is None:
            if images:
                name = type(self.runner.model).__name__
                raise ValueError(f"{name} takes no images (it has no vision tower)")
            return input_ids, ()
        return place_images(
            input_ids,
            images,
            features.image_token_index,
            features.tokens_per_image,
            features.preprocessing,
            self.runner.vocab_size,
        )

    def _stop_scanner(self, params: SamplingParams) -> StopScanner | None:
        """A walk over a request's text for `params.stop`. Its automaton (up to 32 x 1,024
        characters: tens of ms to build) is built once for the n samples of a request, which are
        made one after another from one params object."""
        if not params.stop:
            return None
        if self._last_stops is None or self._last_stops[0] is not params:
            self._last_stops = (params, StopAutomaton(params.stop))
        return StopScanner(self._last_stops[1])

    def with_adapter(self, scope: RequestScope) -> RequestScope:
        """`scope` with its adapter's digest; ValueError (`invalid_request`) for an adapter that
        is not loaded."""
        if not scope.lora_path:
            return scope
        lora = self.runner.lora
        if lora is None or scope.lora_path not in lora.adapters:
            raise ValueError(f"no adapter named {scope.lora_path!r} is loaded")
        return dataclasses.replace(scope, lora_digest=lora.adapters[scope.lora_path].digest)

    # ---- adapters ----------------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> AdapterInfo:
        """Load an adapter on every rank; AdapterError (`invalid_request`) names why not."""
        return self.driver.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Unload an adapter no waiting or running request names (AdapterError otherwise)."""
        users = [r for r in self.waiting + self.running if r.scope.lora_path == name]
        if users:
            raise AdapterError(
                f"adapter {name!r} is in use by {len(users)} requests; unload it later"
            )
        self.driver.unload_lora(name)

    def lora_adapters(self) -> list[AdapterInfo]:
        lora = self.runner.lora
        return [lora.info(n) for n in lora.adapters] if lora is not None else []

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)
        self.tenants.of(req.scope.tenant).requests += 1

    def abort(self, rid: str) -> list[Req]:
        """Abort every waiting or running request whose id is `rid` or starts with `rid-` (samples)."""

        def hit(r: Req) -> bool:
            return r.rid == rid or r.rid.startswith(rid + "-")

        aborted = [r for r in self.waiting + self.running if hit(r)]
        self.counters.aborted_requests += len(aborted)
        for req in aborted:
            req.finish_reason = FinishReason.abort("aborted by the client")
            self._finish(req)
        return aborted

    def pin(self, pin_id: str, input_ids: list[int], salt: str = "", owner: str = "") -> int:
        """Lock the cached prefix of `input_ids` under `salt` so eviction cannot take it (fork's
        shared prefix), on the quota of `owner` (a tenant, or one client connection) within
        the pins' shared budget (`PinBook.pin`). Returns how many tokens are pinned."""
        return self.pins.pin(pin_id, input_ids, salt, owner)

    def unpin(self, pin_id: str) -> bool:
        return self.kv.unpin(pin_id)

    def unpin_all(self, prefix: str) -> int:
        return self.kv.unpin_all(prefix)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_step(self) -> bool:
        """Whether `step()` may run: there is work, generation is not paused and the KV pool
        is not released."""
        return self.has_work() and self.paused is None and not self.kv_released

    def _ready(self, req: Req) -> bool:
        """Whether admission may take `req`: its constraint compiled, and (while an update
        waits) it has started already, so its tokens all come from one weight version."""
        return self.constraints.ready(req) and not (self.holding and req.admitted_at is None)

    # ---- reinforcement learning: new weights, pauses, the pool's memory ----------------------
    def in_flight(self) -> list[Req]:
        """Requests computed under the weights served now: running, or admitted once and
        retracted back to the queue. New weights wait until there are none."""
        return [r for r in self.running + self.waiting if r.admitted_at is not None]

    def update_weights(self, folder: Path, checkpoint: bool, version: str | None) -> WeightUpdate:
        """Serve the weights in `folder` (`ModelRunner.update_weights`: ValueError, naming what
        is refused, with the old weights kept) under `version` (default: the count of updates
        so far), and forget every cached prefix (`KVSlotManager.forget_weights`), so no KV of
        the old weights is ever reused. Only while nothing is in flight (`in_flight`)."""
        if self.in_flight():
            raise RuntimeError("new weights while requests are in flight")
        if not folder.is_dir():
            raise ValueError(f"{str(folder)!r} is not a folder on the runtime's machine")
        start = time.perf_counter()
        try:
            self.driver.update_weights(folder, checkpoint)
        except OSError as e:  # a file that cannot be read: refused, the old weights stay
            raise ValueError(f"the weights could not be read: {e}") from e
        self.weight_updates += 1
        self.weight_version = version or str(self.weight_updates)
        self.kv.forget_weights(uuid.uuid4().hex)
        seconds = time.perf_counter() - start
        logger.info(
            "serving weight version %s from %s (%.2f s)", self.weight_version, folder, seconds
        )
        return WeightUpdate(self.weight_version, seconds)

    def check_weights_group(self, name: str) -> None:
        """ValueError when this runtime cannot join a group named `name` (`TPDriver`)."""
        self.driver.check_weights_group(name)

    def join_weights_group(self, group: WeightsGroupSpec, timeout: float) -> object:
        """Join a trainer's group (`init_weights_update_group`): blocks until it has formed,
        touching nothing of the scheduler's, so it runs beside the serving loop; the group is
        kept once `add_weights_group` takes what this returns."""
        return self.driver.join_weights_group(
            group.address, group.port, group.rank, group.world_size, timeout
        )

    def add_weights_group(self, name: str, joined: object) -> None:
        self.driver.add_weights_group(name, joined)  # type: ignore[arg-type]

    @staticmethod
    def tensor_specs(names: object, dtypes: object, shapes: object) -> list[TensorSpec]:
        """What `update_weights_from_distributed` will receive (`TensorSpec.parse`: checked
        before anything is received, so a refusal leaves the trainer's group in step)."""
        return TensorSpec.parse(names, dtypes, shapes)

    def leave_weights_group(self, name: str) -> None:
        self.driver.leave_weights_group(name)

    def weights_receiver(
        self, name: str, specs: list[TensorSpec]
    ) -> Callable[[], dict[str, torch.Tensor]]:
        """What receives the tensors the trainer broadcasts over group `name`: blocking, and
        run beside the serving loop (`TPDriver.weights_receiver`)."""
        return self.driver.weights_receiver(name, specs)

    def update_weights_from_tensors(
        self, tensors: dict[str, torch.Tensor], version: str | None
    ) -> WeightUpdate:
        """Serve `tensors` (every weight, by its checkpoint name, as a trainer broadcast them)
        as `update_weights` does (checked, atomic): they are handed to it as one safetensors
        file in shared memory, removed after."""
        folder = Path(tempfile.mkdtemp(prefix="radixrt-weights-", dir=tensor_handoff_dir()))
        try:
            save_file(tensors, folder / "model.safetensors")
            return self.update_weights(folder, False, version)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def pause(self, mode: str) -> list[Req]:
        """Stop generating until `resume` (`pause_generation`); under `abort` every waiting and
        running request ends now with what it has (returned: their replies go out)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        ended = self.abort_all("generation was paused (mode abort)") if mode == "abort" else []
        self.paused = mode
        return ended

    def abort_all(self, message: str) -> list[Req]:
        """End every waiting and running request now with what it has (finish reason `abort`,
        no error: a rollout keeps its partial output); returns them, for their replies."""
        ended = self.waiting + self.running
        self.counters.aborted_requests += len(ended)
        for req in ended:
            req.finish_reason = FinishReason.abort(message)
            self._finish(req)
        return ended

    def resume(self) -> None:
        """Generate again after `pause` (`continue_generation`)."""
        self.paused = None

    def release_memory(self) -> None:
        """Free the KV pool's memory on every rank (`release_memory_occupation`): pins released,
        the cache flushed, and no request admitted until `resume_memory`. `invalid_request`
        while requests are in flight (pause with mode abort, or let them finish, first)."""
        busy = len(self.in_flight())
        if busy:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"{busy} requests are in flight: pause_generation with mode abort first, or let "
                "them finish",
            )
        if not self.kv_released:
            self.kv.unpin_all("")
            self.kv.flush()
            self.driver.release_kv()
            self.kv_released = True

    def resume_memory(self) -> None:
        """The KV pool's memory back (`resume_memory_occupation`); requests are admitted again."""
        if self.kv_released:
            self.driver.resume_kv()
            self.kv_released = False

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward; returns the requests that got a new token or finished.

        An exception costs requests, never the loop: one pinned on a request (its sampling,
        logprobs, constraint or detokenizing) ends that request with `internal_error`; any other
        ends the step's requests so, their slots freed. Under tensor parallelism it is raised:
        the ranks' collectives are then out of step, and the process must end."""
        self._ended, self._plan = [], StepPlan()
        try:
            updated = self._step()
        except Exception as e:
            if self.tp_size > 1:
                raise
            updated = self._fail_step(e)
        self.kv.end_event_batch()
        return updated + [r for r in self._ended if r not in updated]

    def _step(self) -> list[Req]:
        self._expire(time.monotonic())
        self.constraints.sweep(self.waiting)
        plan = self.planner.schedule(self._plan).items
        for item in self._plan.admitted:
            item.req.weight_version = item.req.weight_version or self.weight_version
        self.stalled = not plan  # e.g. every waiting request's constraint is still compiling
        self.counters.count_forward(plan)
        start = time.perf_counter()
        updated = []
        if plan:
            updated = self.output.process(
                plan, self.driver.forward(build_batch(plan, self.kv, self.runner.device))
            )
            if decodes_only(plan):
                self.log.decode(len(self.running), len(self.waiting))
        seconds = time.perf_counter() - start
        self.counters.step_time += seconds
        if self.spec is not None:
            self.spec.observe_step(plan, seconds)
        return updated

    def _fail_step(self, error: Exception) -> list[Req]:
        """End the failed step's requests (or, when it failed before any was scheduled, the one
        being admitted) with `internal_error`; a request's own failure is logged and skipped so
        the rest still end."""
        self.counters.failed_steps += 1
        admitting = self._plan.admitting
        victims = list(self._plan.allocated) or ([admitting] if admitting else [])
        logger.exception("a step failed; %d of its requests end with internal_error", len(victims))
        message = f"the runtime failed on this request's step: {type(error).__name__}: {error}"
        for req in victims:
            if req.finished:
                continue
            try:
                self._fail(req, ErrorCode.INTERNAL_ERROR, message)
            except Exception:
                logger.exception("could not free request %s after a failed step", req.rid)
        return victims

    def _fail(self, req: Req, code: ErrorCode, message: str) -> None:
        """End `req` with an error now, freeing the slots this step gave it past its KV."""
        req.finish_reason = FinishReason.abort(message, code)
        allocated = self._plan.allocated.pop(req, None)
        if allocated is not None and req.row is not None:
            self.kv.trim(req, allocated)
        self.kv.forget_state(req)  # a failed step may have left it past the computed tokens
        self._finish(req)

    def _guard(self, req: Req, work: Callable[..., Any], *args: Any) -> bool:
        """Run one request's own `work`; an exception ends that request alone (logged) and
        returns False."""
        try:
            work(*args)
            return True
        except Exception as e:
            logger.exception("request %s failed", req.rid)
            self._fail(req, ErrorCode.INTERNAL_ERROR, internal_error_text(e))
            return False

    def _expire(self, now: float) -> None:
        """End every request past its deadline with `timeout`; its slots are freed here."""
        for req in [r for r in self.waiting + self.running if r.deadline and now >= r.deadline]:
            req.finish_reason = FinishReason.abort(
                f"the request's timeout of {req.scope.timeout} s passed", ErrorCode.TIMEOUT
            )
            self.counters.timed_out_requests += 1
            self.tenants.of(req.scope.tenant).timeouts += 1
            self._finish(req)

    def end_all(self, error: ErrorCode, message: str) -> list[Req]:
        """End every waiting and running request with `error` (a drain that ran out of time)."""
        ended = self.waiting + self.running
        for req in ended:
            req.finish_reason = FinishReason.abort(message, error)
            self._finish(req)
        return ended

    def _finish(self, req: Req) -> None:
        req.finish_time = time.monotonic()
        req.weight_version = req.weight_version or self.weight_version
        if self.spec is not None:
            self.spec.finished(req)
        self._ended.append(req)
        if req in self.running:
            self.kv.release(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        inputs = StatsInputs(
            usage=self.kv.usage(),
            waiting=self.waiting,
            running=self.running,
            tenants=self.tenants,
            tp_size=self.tp_size,
            tp_collective_time=self.runner.tp.collective_time,
            compiles=self.constraints.stats(),
            spec=self.spec.counters if self.spec is not None else SpecCounters(),
            max_loras=self.args.max_loras_per_batch,
            image_encoder_calls=self.runner.image_features.encoder_calls
            if self.runner.image_features is not None
            else 0,
        )
        return {
            **scheduler_stats(self.counters, inputs),
            "weight_version": self.weight_version,
            "generation_paused": self.paused,
            "weight_update_waiting": self.holding,
            "memory_released": self.kv_released,
        }

    def flush_cache(self) -> bool:
        """Drop every cached prefix when nothing runs; then no slot holds KV, and the pool's
        pages go back to the kernel (`drop_pages`)."""
        flushed = not self.has_work() and self.kv.flush()
        self.kv.end_event_batch()
        if flushed:
            self.runner.kv_pool.drop_pages()
        return flushed

    def memory_snapshot(self) -> dict[str, Any]:
        """Who holds which KV slot, as plain data (see `KVSlotManager.snapshot`)."""
        return self.kv.snapshot(self.running, [r.rid for r in self.running])

    def check_invariants(self) -> None:
        """Invariants 2 and 3: every page has one owner, the tree is consistent, locks add up."""
        self.kv.check(self.running)


def build_batch(plan: list[Scheduled], kv: KVSlotManager, device: torch.device) -> ForwardBatch:
    """The forward's flattened ragged batch for `plan`: each request's new tokens, their
    positions after its computed KV, the slots their K/V are written to, (when any has one)
    each request's adapter, and the image placeholders among the new tokens (`image_parts`)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[torch.Tensor] = []
    images: list[ImagePart] = []
    any_adapter = any(s.req.scope.lora_path for s in plan)
    for item in plan:
        req, n = item.req, item.n
        images += image_parts(req, len(ids), n - len(item.draft))
        ids.extend(item.input_ids())
        positions.extend(range(req.kv_len, req.kv_len + n))
        slots.append(kv.slots(req, req.kv_len, n))
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        out_slots=torch.cat(slots).long(),
        rows=torch.tensor([s.req.row for s in plan], dtype=torch.long, device=device),
        prefix_lens=[s.req.kv_len for s in plan],
        extend_lens=[s.n for s in plan],
        lora_names=[s.req.scope.lora_path for s in plan] if any_adapter else None,
        state_slots=torch.tensor([s.req.state_slot for s in plan], dtype=torch.long, device=device)
        if kv.states is not None
        else None,
        images=images or None,
    )


def image_parts(req: Req, row: int, n: int) -> list[ImagePart]:
    """The placeholders among `req`'s next `n` tokens (positions [kv_len, kv_len + n), at the
    batch's rows from `row`): of each image whose span they meet, the rows of its features
    they take. A prefix hit or an earlier chunk that ended inside an image leaves its first
    rows out."""
    start, end = req.kv_len, req.kv_len + n
    parts = []
    for image in req.images:
        lo, hi = max(start, image.start), min(end, image.start + image.length)
        if lo < hi:
            parts.append(
                ImagePart(row + lo - start, image.key, image.picture, lo - image.start, hi - lo)
            )
    return parts


def _sampling_defaults(args: SchedulerArgs, generation_config: dict[str, Any]) -> dict[str, Any]:
    """What a request's unset sampling parameters take (docs/protocol.md): generation_config.json's
    under `--generation-config auto`, none under `ignore`."""
    return generation_defaults(generation_config) if args.generation_config == "auto" else {}


def check_prompt_logprobs(input_ids: list[int], params: SamplingParams, most: int) -> None:
    """`invalid_request` for a request whose prompt logprobs would be more than `most` values
    (`--max-prompt-logprob-entries`): n samples x (the prompt token's + `top_logprobs_num`)
    x the prompt positions scored (from `logprob_start_len` to the end)."""
    if not (params.return_logprob and params.logprob_start_len >= 0):
        return
    scored = max(len(input_ids) - 1 - params.logprob_start_len, 0)
    entries = params.n * (1 + params.top_logprobs_num) * scored
    if entries > most:
        raise RequestError(
            ErrorCode.INVALID_REQUEST,
            f"prompt logprobs of {params.n} samples x {1 + params.top_logprobs_num} values x "
            f"{scored} prompt tokens = {entries}; at most {most} "
            "(--max-prompt-logprob-entries): ask for fewer samples, top logprobs or positions",
        )


def check_prompt(
    input_ids: list[int], params: SamplingParams, vocab: int, context: int, pool: int
) -> None:
    """ValueError for an empty prompt or a token id outside [0, `vocab`) (in the prompt or the
    sampling parameters); `context_length_exceeded` unless the prompt leaves room for one token
    in the context and in the pool."""
    if not input_ids:
        raise ValueError("the prompt is empty")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in input_ids):
        raise ValueError(f"token ids must be ints in [0, {vocab})")
    params.check_vocabulary(vocab)
    limit = min(context, pool)
    if len(input_ids) >= limit:
        raise RequestError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt has {len(input_ids)} tokens; this server takes at most {limit - 1} "
            f"(context length {context}, pool {pool})",
        )


def _cache_settings(args: SchedulerArgs, runner: ModelRunner) -> CacheSettings:
    """The cache settings `args` give; speculation is refused for a recurrent model: a
    rejected draft would have advanced its state past the tokens kept."""
    if runner.model.recurrent and args.speculative_algorithm:
        name = type(runner.model).__name__
        raise ValueError(f"--speculative-algorithm: {name} carries a state per request")
    return CacheSettings.of(args)
