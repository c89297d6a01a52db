"""The router's record of its clients' pins: which worker holds each pinned prefix, so that a
generate extending it goes there (a fork's branches land where their parent's prefix is)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from radixrt.server.router.prefix_tree import Prompt

PIN_SLACK_TOKENS = 2  # a fork's branch re-tokenizes its parent's text: the last tokens may differ


@dataclass(frozen=True)
class Pin:
    worker: int  # the index of the worker that holds it
    prompt: Prompt


def extends(prompt: Prompt, pinned: Prompt) -> bool:
    """Whether `prompt` starts with `pinned`, up to the last few tokens of the pinned prefix,
    in the same namespace (the worker's pin holds its prefix only there)."""
    tokens, prefix = prompt.tokens, pinned.tokens
    need = max(len(prefix) - PIN_SLACK_TOKENS, 1)
    return (
        prompt.namespace == pinned.namespace
        and len(tokens) >= need
        and tokens[:need] == prefix[:need]
    )


class PinBook:
    """Pins by client identity, then by the client's own pin id."""

    def __init__(self) -> None:
        self.by_client: dict[bytes, dict[str, Pin]] = {}

    def add(self, identity: bytes, pin_id: str, pin: Pin) -> None:
        self.by_client.setdefault(identity, {})[pin_id] = pin

    def pop(self, identity: bytes, pin_id: str) -> Pin | None:
        return self.by_client.get(identity, {}).pop(pin_id, None)

    def extended_by(self, identity: bytes, prompt: Prompt) -> Iterator[Pin]:
        """`identity`'s pins that `prompt` extends."""
        return (p for p in self.by_client.get(identity, {}).values() if extends(prompt, p.prompt))

    def forget_client(self, identity: bytes) -> dict[str, Pin]:
        """Drop `identity`'s pins; returns them, so the workers can be told."""
        return self.by_client.pop(identity, {})

    def forget_worker(self, index: int) -> None:
        """Drop the pins worker `index` held (it is gone, and its pins with it)."""
        for pins in self.by_client.values():
            for pin_id in [p for p, pin in pins.items() if pin.worker == index]:
                del pins[pin_id]
