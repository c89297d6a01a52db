"""The radixrt DSL: programs of gen/select/roles/fork over a runtime (see radixrt.Runtime)."""

from radixrt.frontend.chat import ChatReply, chat
from radixrt.frontend.function import Function, function, set_default_backend
from radixrt.frontend.openai_backend import OpenAI, SelectUnsupported
from radixrt.frontend.primitives import (
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
from radixrt.frontend.state import ForkGroup, ProgramState
from radixrt.frontend.tools import tools_prompt

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
