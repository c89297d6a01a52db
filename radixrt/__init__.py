"""radixrt: a RadixAttention-centric structured-generation runtime."""

from radixrt.config import ServerArgs
from radixrt.engine import Engine
from radixrt.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams", "ServerArgs"]
__version__ = "0.1.0"
