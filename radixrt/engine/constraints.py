"""Structured output as one object: a request's constraint compiles in the compiler's worker
processes while it waits, and its walk (a `GrammarGuide`) starts when admission first looks at it.
With `--reasoning-parser`, a constraint starts after the reasoning block, and a request's
`max_reasoning_tokens` bounds that block (`structured/reasoning.py`). A request whose constraint failed (`invalid_constraint`) or that the compiler would not take in
time (`overloaded`) ends at the next step, wherever it waits in the queue (`sweep`).
The compiler (and its workers) exists from the first constrained request on."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixrt.engine.request import FinishReason, Req
from radixrt.protocol import ErrorCode
from radixrt.sampling_params import SamplingParams
from radixrt.structured.compiler import CompileStats, ConstraintCompiler
from radixrt.structured.grammar import CompilerBusy, GrammarGuide
from radixrt.structured.reasoning import OPENS_THINKING, ReasoningGuide, ThinkTags

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Constraints:
    """Compiles requests' constraints and starts their walks; `finish` ends a request whose
    constraint failed."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        compile_timeout_s: float,
        compiles_per_tenant: int,
        grammar_backend: str,
        jump_forward: bool,
        finish: Callable[[Req], None],
        reasoning_parser: str | None = None,
        stop_ids: frozenset[int] = frozenset(),
    ):
        """`reasoning_parser`: the one that runs (constraints wait for the block's end), if any;
        `stop_ids`: the model's EOS ids, which a reply may not write while it reasons."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.compiles_per_tenant = compiles_per_tenant
        self.grammar_backend = grammar_backend
        self.jump_forward = jump_forward
        self.finish = finish
        self.reasoning_parser = reasoning_parser
        self.stop_ids = stop_ids
        self.compiler: ConstraintCompiler | None = None
        self._tags: ThinkTags | None = None

    def _compiler(self) -> ConstraintCompiler:
        if self.compiler is None:
            self.compiler = ConstraintCompiler(
                self.tokenizer,
                self.vocab_size,
                compile_timeout_s=self.compile_timeout_s,
                backend=self.grammar_backend,
                compiles_per_tenant=self.compiles_per_tenant,
            )
        return self.compiler

    @property
    def eos_token_id(self) -> int:
        """The token a complete constraint finishes with."""
        return self._compiler().eos_token_id

    def start(self, req: Req, params: SamplingParams) -> None:
        """Start compiling the request's constraint, if it has one (admission waits for it); the
        samples of one request share one compile (the compiler's cache)."""
        if params.max_reasoning_tokens is not None and self.reasoning_parser is None:
            raise ValueError("max_reasoning_tokens needs a server started with --reasoning-parser")
        constraint = params.constraint()
        if constraint is not None:
            # the value is the client's, of any type: the compiler checks it
            given: dict[str, Any] = {constraint[0]: constraint[1]}
            req.constraint = self._compiler().compile_async(**given, tenant=req.scope.tenant)
        elif params.max_reasoning_tokens is not None:
            req.guide = self._after_reasoning(req, None)

    def _after_reasoning(self, req: Req, guide: GrammarGuide | None) -> GrammarGuide | None:
        """The request's walk, started after the reasoning block when a reasoning parser runs."""
        if self.reasoning_parser is None:
            return guide
        if self._tags is None:
            compiler = self._compiler()
            self._tags = ThinkTags.build(compiler.tokens, {*self.stop_ids, compiler.eos_token_id})
        return ReasoningGuide(
            self._tags,
            guide,
            req.input_ids,
            req.params.max_reasoning_tokens,
            inside=OPENS_THINKING[self.reasoning_parser],
        )

    def ready(self, req: Req) -> bool:
        """False while the request's constraint compiles; a failed compile, or any failure to
        start its walk, ends that request alone with `invalid_constraint` (`overloaded` when the
        compiler would not take it in time)."""
        if req.constraint is None or req.guide is not None:
            return True
        if not self._compiler().ready(req.constraint):
            return False
        try:
            # forced tokens get no logprobs
            jump = self.jump_forward and not req.params.return_logprob
            req.guide = self._after_reasoning(req, req.constraint.result().guide(jump_forward=jump))
            return True
        except Exception as e:  # noqa: BLE001 (whatever the constraint raised is its own fault)
            message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            code = (
                ErrorCode.OVERLOADED
                if isinstance(e, CompilerBusy)
                else ErrorCode.INVALID_CONSTRAINT
            )
            req.finish_reason = FinishReason.abort(message, code)
            self.finish(req)
            return False

    def sweep(self, waiting: list[Req]) -> None:
        """End every waiting request whose compile has failed, however far back it waits
        (admission stops looking once a step is full). Drives the compiler first."""
        if self.compiler is None:
            return
        self.compiler.poll()
        for req in [r for r in waiting if r.constraint is not None and r.guide is None]:
            if req.constraint is not None and req.constraint.error is not None:
                self.ready(req)

    def poll(self) -> None:
        """While idle: the compiler stops its idle workers."""
        if self.compiler is not None:
            self.compiler.poll()

    def stats(self) -> CompileStats:
        return self.compiler.stats() if self.compiler else CompileStats()

    def close(self) -> None:
        """Kill the compiler's workers."""
        if self.compiler is not None:
            self.compiler.close()
