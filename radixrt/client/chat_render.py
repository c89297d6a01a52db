"""Chat templates rendered as transformers' `apply_chat_template` renders them, in a sandbox that
bounds what one render may build; run as a script, the render worker of the HTTP gateway
(`radixrt.server.http.template_pool`).

A chat template comes with the model (GGUF metadata, tokenizer_config.json) or `--chat-template`,
and a request's messages reach it: a template is code that runs on request data. It runs here
in jinja2's `ImmutableSandboxedEnvironment` (no attribute escapes, no mutation of lists and
dicts) with what transformers gives it (`raise_exception`, `strftime_now`, its `tojson`, `dict`,
`namespace` without underscore names, the `{% generation %}` tag, loop controls), the same
variables (the tokenizer's special tokens, then the caller's; `messages`, `tools`, `documents`,
`add_generation_prompt`) and the same message preparation (keys whose value is None dropped,
reasoning aliased, `continue_final_message` cut at its tag). `BoundedSandbox` adds bounds:
- a string built by repetition (`'a' * n`), concatenation (`+`, `~`), `%`-formatting, a width
  (`center`, `ljust`, `indent`, ...), `replace` or `join` may not pass the render's output limit
  (`Limits.max_chars`: the gateway's `--max-prompt-bytes`), a list built by repetition or `+` not
  MAX_ITEMS items, an integer not MAX_INT_BITS bits;
- `range` gives at most RANGE_PER_CALL items a call and RANGE_PER_RENDER in one render;
- the output stops at the limit (it is generated piece by piece and counted).
Each such refusal is a `TemplateLimitError` naming the bound. What a template could still do
past these (a macro that doubles its text, loops over loops) is bounded where it runs: the
worker process has an address-space limit and is killed past `--chat-template-timeout`.

The worker (`python -I chat_render.py SOCKET_FD MEMORY_BYTES`) imports only the standard library
and jinja2, so it starts in a tenth of a second. Over the socket SOCKET_FD
(`multiprocessing.connection` framing) it answers READY once, then each job (a `RenderJob` as
JSON) with OK + the prompt as UTF-8, LIMIT + a message (a bound above, memory, recursion) or
ERROR + a message (the template's own error or what it could not do with the request's values).
It dies with its parent (PR_SET_PDEATHSIG), and its address space is capped at MEMORY_BYTES."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import re
import resource
import signal
import string
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import update_wrapper
from multiprocessing.connection import Connection
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.runtime import Context, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, pass_eval_context

READY, OK, LIMIT, ERROR = b"R", b"O", b"L", b"E"
PR_SET_PDEATHSIG = 1

MAX_ITEMS = 1_000_000  # a list built by repetition or concatenation
RANGE_PER_CALL = 100_000  # jinja2's own MAX_RANGE
RANGE_PER_RENDER = 2_000_000
MAX_INT_BITS = 1 << 16  # an integer built by `*` or `**`
MAX_JSON_INDENT = 256  # tojson's indent and separators
DEFAULT_MAX_CHARS = 1 << 22  # in-process renders (the DSL, the bench): --max-prompt-bytes' default
COMPILED_TEMPLATES = 8  # per renderer (the model's template, its tool_use one, ...)

# transformers' `apply_chat_template` takes these itself: they are never template variables
CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateLimitError(Exception):
    """The template passed one of the render's bounds (the message names it)."""


@dataclass
class Limits:
    """One render's bounds: its output (and any string it builds) in characters, and the `range`
    items it has left."""

    max_chars: int = DEFAULT_MAX_CHARS
    range_left: int = RANGE_PER_RENDER


_LIMITS: ContextVar[Limits] = ContextVar("chat_render_limits", default=Limits())  # noqa: B039


def _limits() -> Limits:
    return _LIMITS.get()


def _over(what: str, size: int, bound: int, unit: str = "chars") -> TemplateLimitError:
    return TemplateLimitError(
        f"the chat template built {what} of {size} {unit}; at most {bound}"
        + (" (the output limit, --max-prompt-bytes)" if unit == "chars" else "")
    )


def _check_chars(what: str, size: int) -> None:
    bound = _limits().max_chars
    if size > bound:
        raise _over(what, size, bound)


def _check_repeat(seq: Any, times: Any) -> None:
    if not isinstance(times, int) or times <= 0:
        return
    if isinstance(seq, (str, bytes)):
        _check_chars("a repeated string", len(seq) * times)
    elif isinstance(seq, (list, tuple)) and len(seq) * times > MAX_ITEMS:
        raise _over("a repeated list", len(seq) * times, MAX_ITEMS, "items")


def _check_concat(left: Any, right: Any) -> None:
    if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
        _check_chars("a string", len(left) + len(right))
    elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        if len(left) + len(right) > MAX_ITEMS:
            raise _over("a list", len(left) + len(right), MAX_ITEMS, "items")


def _check_int_product(left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int):
        bits = left.bit_length() + right.bit_length()
        if bits > MAX_INT_BITS:
            raise _over("an integer", bits, MAX_INT_BITS, "bits")


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        bits = exponent * (abs(base).bit_length() - 1) + 1
        if bits > MAX_INT_BITS:
            raise _over("an integer", bits, MAX_INT_BITS, "bits")


def _check_widths(numbers: list[int]) -> None:
    for number in numbers:
        _check_chars("a padded string", number)


_PRINTF_WIDTHS = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(fmt: str, values: Any) -> None:
    """`fmt % values` pads to no width past the output limit (`*` takes its width from
    `values`)."""
    numbers, starred = [], False
    for width, precision in _PRINTF_WIDTHS.findall(fmt):
        for part in (width, precision):
            if part == "*":
                starred = True
            elif part:
                numbers.append(int(part))
    if starred:
        given = values if isinstance(values, tuple) else (values,)
        numbers += [v for v in given if isinstance(v, int)]
    _check_widths(numbers)


def _check_format_spec(fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """`fmt.format(...)` pads to no width past the output limit (a nested `{}` takes its width
    from the arguments)."""
    numbers: list[int] = []
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # format() itself refuses it
    for _, _, spec, _ in fields:
        if not spec:
            continue
        numbers += [int(n) for n in re.findall(r"\d+", spec)]
        if "{" in spec:
            numbers += [v for v in (*args, *kwargs.values()) if isinstance(v, int)]
    _check_widths(numbers)


def _check_replace(s: str, old: Any, new: Any, count: Any) -> None:
    if not (isinstance(old, str) and isinstance(new, str)):
        return
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    _check_chars("a string", len(s) + hits * (len(new) - len(old)))


def _check_join(separator: str, items: Any) -> None:
    if isinstance(items, (list, tuple)):
        size = sum(len(x) for x in items if isinstance(x, str))
        _check_chars("a joined string", size + len(separator) * max(0, len(items) - 1))


def _check_str_method(s: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Bounds on the str methods whose result can be far larger than their inputs."""
    if name in ("center", "ljust", "rjust", "zfill"):
        width = args[0] if args else kwargs.get("width")
        if isinstance(width, int):
            _check_chars("a padded string", width)
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _check_chars("a string", len(s) + s.count("\t") * size)
    elif name == "replace":
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        if len(args) >= 2:
            _check_replace(s, args[0], args[1], count)
    elif name == "join" and args:
        _check_join(s, args[0])
    elif name == "format":
        _check_format_spec(s, args, kwargs)
    elif name == "format_map" and args and isinstance(args[0], dict):
        _check_format_spec(s, (), args[0])


def bounded_range(*args: int) -> range:
    """jinja2's sandboxed `range`, and a budget of items for the whole render."""
    rng = range(*args)
    if len(rng) > RANGE_PER_CALL:
        raise _over("a range", len(rng), RANGE_PER_CALL, "items")
    limits = _limits()
    limits.range_left -= len(rng)
    if limits.range_left < 0:
        raise TemplateLimitError(
            f"the chat template's ranges passed {RANGE_PER_RENDER} items in one render"
        )
    return rng


def bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    if isinstance(n, int) and isinstance(max, int) and isinstance(min, int):
        _check_chars("lorem ipsum", n * builtins_max(min, max) * 16)
    return str(jinja2.utils.generate_lorem_ipsum(n, html, min, max))


builtins_max = max


# ---- transformers' helpers (transformers.utils.chat_template_utils), as it defines them --------
def raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson` (no HTML escaping; its options), with its indent and separators
    bounded."""
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:
        raise _over("a JSON indent", indent, MAX_JSON_INDENT, "spaces")
    if isinstance(indent, str) and len(indent) > MAX_JSON_INDENT:
        raise _over("a JSON indent", len(indent), MAX_JSON_INDENT, "chars of indent")
    if isinstance(separators, (list, tuple)):
        size = sum(len(s) for s in separators if isinstance(s, str))
        if size > MAX_JSON_INDENT:
            raise _over("JSON separators", size, MAX_JSON_INDENT, "chars of separators")
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def strftime_now(format: str) -> str:  # noqa: A002
    return datetime.now().strftime(format)


class TemplateDict:
    """`dict` for templates without its attributes (no type hackery)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(Namespace):
    """A `namespace` that takes no underscore-prefixed names (CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any):  # noqa: N805 (jinja2's Namespace signature)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                f"got {name!r}. Please rename the attribute."
            )


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tracker): the body
    as it is; the gateway asks for no masks."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body", [], [], lineno=lineno)
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


# ---- the sandbox ---------------------------------------------------------------------------------
class _BoundedCodeGenerator(CodeGenerator):
    """`a ~ b` through `environment.concat_bounded`, which checks the joined size first."""

    @optimizeconst
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:
            mode = "volatile"
        elif frame.eval_ctx.autoescape:
            mode = "markup"
        else:
            mode = "str"
        self.write(f"environment.concat_bounded(context, {mode!r}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _bounded_filter(original: Callable[..., Any], check: Callable[..., None]) -> Any:
    """`original` (a jinja2 filter) after `check` of the same arguments (less the eval context
    a `pass_eval_context` filter takes first)."""
    if getattr(original, "jinja_pass_arg", None) is not None:

        @pass_eval_context
        def with_context(eval_ctx: Any, *args: Any, **kwargs: Any) -> Any:
            check(*args, **kwargs)
            return original(eval_ctx, *args, **kwargs)

        return update_wrapper(with_context, original)

    def plain(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        return original(*args, **kwargs)

    return update_wrapper(plain, original)


def _center_check(value: Any, width: Any = 80) -> None:
    if isinstance(width, int):
        _check_chars("a padded string", builtins_max(width, len(str(value))))


def _indent_check(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> None:
    lines = str(s).count("\n") + 1
    step = width if isinstance(width, int) else len(width) if isinstance(width, str) else 0
    _check_chars("an indented string", len(str(s)) + lines * step)


def _format_check(value: Any, *args: Any, **kwargs: Any) -> None:
    _check_printf(str(value), kwargs or args)


def _join_check(value: Any, d: Any = "", attribute: Any = None) -> None:
    if attribute is None and isinstance(d, str):
        _check_join(d, value)


def _replace_check(s: Any, old: Any, new: Any, count: Any = None) -> None:
    _check_replace(str(s), old, new, -1 if count is None else count)


def _batch_check(value: Any, linecount: Any, fill_with: Any = None) -> None:
    if isinstance(linecount, int) and linecount > MAX_ITEMS:
        raise _over("a batch", linecount, MAX_ITEMS, "items")


def _slice_check(value: Any, slices: Any, fill_with: Any = None) -> None:
    if isinstance(slices, int) and slices > MAX_ITEMS:
        raise _over("slices", slices, MAX_ITEMS, "items")


_FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "center": _center_check,
    "indent": _indent_check,
    "format": _format_check,
    "join": _join_check,
    "replace": _replace_check,
    "batch": _batch_check,
    "slice": _slice_check,
}


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with the bounds of the module docstring: the
    binary operators that build strings, lists and integers (`*`, `+`, `**`, `%`) and `~` are
    checked before they run, as are the str methods and filters that pad, replace or join."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[GenerationTag, jinja2.ext.loopcontrols],
        )
        for name, check in _FILTER_CHECKS.items():
            self.filters[name] = _bounded_filter(self.filters[name], check)
        self.filters["tojson"] = tojson
        self.globals.update(
            range=bounded_range,
            lipsum=bounded_lipsum,
            raise_exception=raise_exception,
            strftime_now=strftime_now,
            dict=TemplateDict(),
            namespace=TemplateNamespace,
        )

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_repeat(left, right)
            _check_repeat(right, left)
            _check_int_product(left, right)
        elif operator == "+":
            _check_concat(left, right)
        elif operator == "**":
            _check_power(left, right)
        elif operator == "%" and isinstance(left, str):
            _check_printf(left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        # a str's method, or the sandbox's wrapper of its format/format_map
        method = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(owner, getattr(method, "__name__", ""), args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def concat_bounded(self, context: Context, mode: str, parts: tuple[Any, ...]) -> str:
        """`a ~ b ~ ...` (jinja2's `str_join` or `markup_join`, as its code generator picks),
        checked against the output limit first."""
        texts = [p if isinstance(p, str) else str(p) for p in parts]
        _check_chars("a string", sum(len(t) for t in texts))
        markup = mode == "markup" or (mode == "volatile" and context.eval_ctx.volatile)
        return str(markup_join(texts) if markup else str_join(texts))


# ---- one render ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RenderJob:
    """What a render needs, all of it JSON: the template's text (transformers'
    `get_chat_template` picked it), the messages, the tools a template renders (None: none),
    the variables (the tokenizer's special tokens, then `chat_template_kwargs`), and the
    output limit in UTF-8 bytes."""

    template: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    variables: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    max_bytes: int = DEFAULT_MAX_CHARS

    def to_json(self) -> bytes:
        # surrogatepass: a lone surrogate a JSON body may hold reaches the template as it came
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # no deep copy
        return json.dumps(fields, ensure_ascii=False).encode("utf-8", "surrogatepass")

    @classmethod
    def from_json(cls, data: bytes) -> RenderJob:
        return cls(**json.loads(data.decode("utf-8", "surrogatepass")))


def _normalize(messages: list[Any]) -> list[dict[str, Any]]:
    """transformers' `_normalize_chat_messages` and `_alias_reasoning_fields`: dicts, without
    the keys whose value is None; a message's reasoning under each name templates read."""
    chat = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _tag_final_message(template: str, chat: list[dict[str, Any]]) -> str:
    """transformers' `continue_final_message` (its "content" field): the final message's text
    with the tag after it, which the rendering is then cut at; the text it continues."""
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    final = chat[-1].get("content")
    if final is None:
        raise ValueError(
            'continue_final_message is set but the final message has no "content" to continue!'
        )
    if "content" not in template:
        raise ValueError(
            'continue_final_message is set to "content" but this is not an accepted field in '
            "the chat_template"
        )
    if isinstance(final, (list, tuple)):
        # copies: the caller's blocks stay as they were
        blocks = chat[-1]["content"] = [dict(b) if isinstance(b, dict) else b for b in final]
        for block in reversed(blocks):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + CONTINUE_FINAL_MESSAGE_TAG
                return str(text)
        raise ValueError(
            "continue_final_message is set but we could not find any text to continue in the "
            "final message!"
        )
    chat[-1]["content"] = final + CONTINUE_FINAL_MESSAGE_TAG
    return str(final)


def _cut_at_tag(rendered: str, final: str) -> str:
    tag = CONTINUE_FINAL_MESSAGE_TAG
    if final.strip() not in rendered or tag.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            "portions of the final message. Please verify the chat template and final message "
            "in your chat to ensure they are compatible."
        )
    at = rendered.rindex(tag.strip())
    if rendered[at : at + len(tag)] == tag:
        return rendered[:at]
    return rendered[:at].rstrip()


class Renderer:
    """Renders jobs in one sandbox, keeping the last COMPILED_TEMPLATES templates compiled. Not
    for concurrent use (one per worker, or one per call)."""

    def __init__(self) -> None:
        self.env = BoundedSandbox()
        self.compiled: OrderedDict[str, jinja2.Template] = OrderedDict()

    def template(self, text: str) -> jinja2.Template:
        compiled = self.compiled.pop(text, None) or self.env.from_string(text)
        self.compiled[text] = compiled
        while len(self.compiled) > COMPILED_TEMPLATES:
            self.compiled.popitem(last=False)
        return compiled

    def render(self, job: RenderJob) -> str:
        """The prompt; a TemplateLimitError past a bound, or what the template raised (its
        TemplateError, or a ValueError/TypeError for what it cannot do with the values)."""
        # the output counted as it is made: past max_bytes characters it is past max_bytes bytes
        # (the cut of continue_final_message may take back what follows the tag)
        slack = 1 << 16 if job.continue_final_message else 0
        with _bounded(job.max_bytes + slack):
            template = self.template(job.template)
            chat = _normalize(job.messages)
            final = _tag_final_message(job.template, chat) if job.continue_final_message else ""
            pieces, size = [], 0
            for piece in template.generate(
                messages=chat,
                tools=job.tools,
                documents=None,
                add_generation_prompt=job.add_generation_prompt,
                **job.variables,
            ):
                size += len(piece)
                if size > job.max_bytes + slack:
                    raise output_over(job.max_bytes)
                pieces.append(piece)
        rendered = "".join(pieces)
        prompt = _cut_at_tag(rendered, final) if job.continue_final_message else rendered
        if len(prompt) > job.max_bytes or len(prompt.encode()) > job.max_bytes:
            raise output_over(job.max_bytes)
        return prompt


def output_over(max_bytes: int) -> TemplateLimitError:
    return TemplateLimitError(
        f"the chat template's output is over {max_bytes} bytes (--max-prompt-bytes)"
    )


@contextmanager
def _bounded(max_chars: int) -> Iterator[None]:
    token = _LIMITS.set(Limits(max_chars))
    try:
        yield
    finally:
        _LIMITS.reset(token)


def render(job: RenderJob) -> str:
    """One job rendered in this process, in a sandbox of its own (no time limit: the gateway's
    renders go to `template_pool`'s workers)."""
    return Renderer().render(job)


def describe(e: BaseException) -> tuple[bytes, str]:
    """A failed render's verdict (LIMIT or ERROR) and its message for the client."""
    if isinstance(e, TemplateLimitError):
        return LIMIT, str(e)
    if isinstance(e, MemoryError):
        return LIMIT, "the chat template ran out of memory (the render worker's limit)"
    if isinstance(e, RecursionError):
        return LIMIT, "the chat template recursed too deeply"
    if isinstance(e, OverflowError):  # a number too large for what the template does with it
        return LIMIT, f"the chat template built a value too large: {e}"
    if isinstance(e, (jinja2.TemplateError, ValueError, TypeError)):
        return ERROR, str(e)
    return ERROR, f"{type(e).__name__}: {e}"


def answer(job: bytes, renderer: Renderer) -> bytes:
    """The reply to one job."""
    try:
        return OK + renderer.render(RenderJob.from_json(job)).encode()
    except Exception as e:  # noqa: BLE001 (whatever the template raised is this job's verdict)
        verdict, message = describe(e)
        return verdict + message.encode()


# ---- the worker process ------------------------------------------------------------------------
def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(socket_fd: int, memory_bytes: int) -> None:
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    conn = Connection(socket_fd)
    renderer = Renderer()
    conn.send_bytes(READY)
    while True:
        try:
            job = conn.recv_bytes()
            conn.send_bytes(answer(job, renderer))
        except (EOFError, OSError):  # the parent closed the socket: this worker is done
            return


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
