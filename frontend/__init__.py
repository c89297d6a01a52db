"""The radixrt DSL: programs of gen/select/roles/fork over a runtime (see radixrt.Runtime)."""

from .chat import ChatReply, chat
from .function import Function, function, set_default_backend
from .openai_backend import OpenAI, SelectUnsupported
from .primitives import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from .state import ForkGroup, ProgramState
from .tools import tools_prompt

__all__ = [
    "ChatReply",
    "ForkGroup",
    "Function",
    "OpenAI",
    "ProgramState",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "chat",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "select",
    "SelectUnsupported",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "tools_prompt",
    "user",
    "user_begin",
    "user_end",
]
