"""radixrt: a RadixAttention-centric structured-generation runtime."""

import os as _os
import sys as _sys

# Started in the checkout's root (`python -m radixrt serve`, as the docs print it), Python puts
# that folder first on sys.path, where kernels/ (installed as radixrt.kernels) would take the
# import name of Hugging Face's `kernels`, which transformers imports. That entry is dropped,
# as the console script and the launchers' `-P` never add it; radixrt itself is already found.
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _sys.path and _os.path.abspath(_sys.path[0] or ".") == _ROOT:
    del _sys.path[0]

from radixrt import frontend  # noqa: E402
from radixrt.client.endpoint import RequestOptions, RuntimeEndpoint  # noqa: E402
from radixrt.client.launcher import Engine, Runtime  # noqa: E402
from radixrt.config import ServerArgs  # noqa: E402
from radixrt.frontend import *  # noqa: E402, F403 (the DSL: the names frontend.__all__ lists)
from radixrt.sampling_params import SamplingParams  # noqa: E402

__all__ = ["Engine", "RequestOptions", "Runtime", "RuntimeEndpoint", "SamplingParams", "ServerArgs"]
__all__ += frontend.__all__
__version__ = "0.1.0"
