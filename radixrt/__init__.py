"""radixrt: a RadixAttention-centric structured-generation runtime."""

from radixrt import frontend
from radixrt.client.endpoint import RequestOptions, RuntimeEndpoint
from radixrt.client.launcher import Engine, Runtime
from radixrt.config import ServerArgs
from radixrt.frontend import *  # noqa: F403 (the DSL: the names frontend.__all__ lists)
from radixrt.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOptions", "Runtime", "RuntimeEndpoint", "SamplingParams", "ServerArgs"]
__all__ += frontend.__all__
__version__ = "0.1.0"
