"""``MissSplit``: the deterministic share of misses a split sends one way (``--pcie-frac``; a computing
peer's prompt ``stream`` share)."""

from __future__ import annotations

__all__ = ["MissSplit"]


class MissSplit:
    """Deterministic ``--pcie-frac`` split of decode misses: a running credit, so the share holds
    across layers even with one miss per layer. ``take(n)`` = how many of ``n`` misses use the link."""

    def __init__(self, frac: float):
        self.frac, self.credit = frac, 0.0

    def take(self, n: int) -> int:
        link = self.peek(n)
        self.credit += n * self.frac
        self.credit -= link
        return link

    def peek(self, n: int) -> int:
        """What ``take(n)`` would return now, without taking it (a prediction)."""
        return min(n, int(self.credit + n * self.frac + 1e-9))
