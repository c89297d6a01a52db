"""radixrt: a RadixAttention-centric structured-generation runtime."""

from radixrt.client.endpoint import RuntimeEndpoint
from radixrt.client.launcher import Engine, Runtime
from radixrt.config import ServerArgs
from radixrt.frontend import (
    ForkGroup,
    Function,
    ProgramState,
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    gen_int,
    gen_string,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixrt.sampling_params import SamplingParams

__all__ = [
    "Engine",
    "ForkGroup",
    "Function",
    "ProgramState",
    "Runtime",
    "RuntimeEndpoint",
    "SamplingParams",
    "ServerArgs",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "user",
    "user_begin",
    "user_end",
]
__version__ = "0.1.0"
