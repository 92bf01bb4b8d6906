"""A measured time beside its floor (chapters 3, 4, 5 and every lab that times a forward).

The book has one lower bound, ``max(F/P, M/W)`` (``minillm.lab.estimate.Floor``). A lab times some
work, computes the floor of the same work from the ledger and the machine profile, and reads the
pair the same way everywhere: which ceiling binds, what share of the measured time the floor is,
and how much of the bandwidth (MBU) and of the compute rate (MFU) the measurement used.
"""
from __future__ import annotations

from dataclasses import dataclass

from minillm.lab.estimate import Floor
from minillm.lab.report import floor_words

HEADER = ["实测", "下界", "下界 ÷ 实测", "MBU（带宽利用）", "MFU（算力利用）"]


@dataclass(frozen=True)
class Timed:
    """``seconds`` measured for work whose floor is ``floor``."""

    seconds: float
    floor: Floor

    @property
    def share(self) -> float:
        """The floor as a share of the measured time: 1 means the work hit a ceiling."""
        return self.floor.seconds / self.seconds

    @property
    def mbu(self) -> float:
        """Bytes the ledger says the work moves, per measured second, over the bandwidth W."""
        return self.floor.bytes / self.seconds / self.floor.bandwidth

    @property
    def mfu(self) -> float:
        """FLOPs the ledger counts, per measured second, over the compute rate P."""
        return self.floor.flops / self.seconds / self.floor.peak_flops

    def cells(self, digits: int = 2) -> list[str]:
        """The table cells of :data:`HEADER`."""
        return [f"{self.seconds * 1e3:,.{digits}f} ms", floor_words(self.floor), f"{self.share:.0%}",
                f"{self.mbu:.0%}", f"{self.mfu:.0%}"]

    def as_dict(self) -> dict:
        """The values a claim may read: seconds, floor_s, bound, share, mbu, mfu, flops, bytes."""
        return {"seconds": self.seconds, "floor_s": self.floor.seconds, "bound": self.floor.bound,
                "share": self.share, "mbu": self.mbu, "mfu": self.mfu,
                "flops": self.floor.flops, "bytes": self.floor.bytes}
