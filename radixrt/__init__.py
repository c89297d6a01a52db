"""radixrt: a RadixAttention-centric structured-generation runtime."""

from radixrt.config import ServerArgs
from radixrt.endpoint import RuntimeEndpoint
from radixrt.runtime import Engine, Runtime
from radixrt.sampling_params import SamplingParams

__all__ = ["Engine", "Runtime", "RuntimeEndpoint", "SamplingParams", "ServerArgs"]
__version__ = "0.1.0"
