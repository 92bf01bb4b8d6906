"""A measured time beside its floor (minillm.lab.floors.Timed), as every timing lab reads it."""
import pytest

from minillm.lab import estimate as L
from minillm.lab.floors import HEADER, Timed
from minillm.lab.report import floor_words


def test_a_time_beside_its_floor():
    floor = L.roofline_floor(2e9, 4e8, peak_flops=1e11, bandwidth=1e10)  # F/P 20 ms, M/W 40 ms
    assert floor.bound == "memory" and floor.seconds == pytest.approx(0.04)
    t = Timed(0.08, floor)
    assert (t.share, t.mbu, t.mfu) == pytest.approx((0.5, 0.5, 0.25))
    assert t.cells() == ["80.00 ms", floor_words(floor), "50%", "50%", "25%"] and len(t.cells()) == len(HEADER)
    values = t.as_dict()
    assert values.pop("bound") == "memory"
    assert values == pytest.approx({"seconds": 0.08, "floor_s": 0.04, "share": 0.5, "mbu": 0.5, "mfu": 0.25,
                                    "flops": 2e9, "bytes": 4e8})


def test_a_time_under_its_floor_reads_over_one():
    """The machine profile's P and W are one square matmul and one copy: a read-only pass or a
    model-shaped matmul can beat them, and the share then reads above 100%, as the pages explain."""
    floor = L.roofline_floor(8e9, 1e8, peak_flops=1e11, bandwidth=1e10)  # compute-bound, 80 ms
    t = Timed(0.05, floor)
    assert floor.bound == "compute" and t.share == pytest.approx(1.6) and t.mfu == pytest.approx(1.6)
    assert t.cells()[2] == "160%"
