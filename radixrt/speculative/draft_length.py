"""How many tokens to draft for one request next: grows while drafts are accepted, shrinks and
then pauses while they are rejected, so text with nothing to copy costs almost nothing."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE_STEPS = 32  # longest pause after consecutive wholly rejected drafts


@dataclass
class DraftLength:
    """Per request. A fully accepted draft doubles the next length (up to `limit`); a partly
    accepted one sets it to what was accepted plus one; a wholly rejected one halves it and
    pauses drafting for 2, 4, 8 ... steps (at most MAX_PAUSE_STEPS) while rejections repeat."""

    limit: int
    current: int = 0
    pause: int = 0  # steps left without drafts
    misses: int = 0  # wholly rejected drafts in a row

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError("the draft length limit must be >= 1")
        self.current = self.current or self.limit

    def next(self) -> int:
        """Tokens to draft this step (0 while paused); counts a paused step."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.current

    def update(self, offered: int, accepted: int) -> None:
        """After a verification of `offered` drafted tokens of which `accepted` matched."""
        if offered == 0:
            return
        if accepted == offered:
            self.current = min(2 * self.current, self.limit)
            self.misses = 0
        elif accepted == 0:
            self.current = max(self.current // 2, 1)
            self.misses += 1
            self.pause = min(2**self.misses, MAX_PAUSE_STEPS)
        else:
            self.current = min(accepted + 1, self.limit)
            self.misses = 0
