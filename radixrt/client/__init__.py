"""The caller's side: the DEALER transport, `RuntimeEndpoint`, and the `Runtime`/`Engine` launchers.

Imports neither the engine nor torch, so a client (or the HTTP gateway) starts in milliseconds.
"""

from radixrt.client.endpoint import RuntimeEndpoint
from radixrt.client.launcher import Engine, Runtime
from radixrt.client.transport import RemoteError

__all__ = ["Engine", "RemoteError", "Runtime", "RuntimeEndpoint"]
