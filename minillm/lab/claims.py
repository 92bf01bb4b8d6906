"""Sentences whose truth depends on a measurement (all chapters).

A page may state what a measurement shows only in one of two ways: the wording is chosen by code
from the values (:func:`choose`, between whole sentences), or the sentence is written out and
guarded by :func:`claim`. In the book build (``MINILLM_STRICT_CLAIMS=1``, which ``scripts/book.sh``
and ``scripts/test.sh`` set) a claim the numbers no longer support fails the build, so a reader
never meets prose that its own glued numbers contradict. In a reader's own run of a lab, on another
machine, it prints a note saying which sentence this machine's numbers do not bear out, and the lab
goes on.
"""
from __future__ import annotations

import os

STRICT = "MINILLM_STRICT_CLAIMS"


class ClaimError(AssertionError):
    """A sentence of the book no longer holds for the numbers this build measured."""


def strict() -> bool:
    """True in the book build: a false claim raises instead of printing a note."""
    return os.environ.get(STRICT, "").strip().lower() in ("1", "true", "yes", "on")


def claim(holds: bool, sentence: str, **values) -> bool:
    """``holds``, checked: the book says ``sentence`` about ``values``. False raises
    ``ClaimError`` in the book build and prints a note anywhere else."""
    if holds:
        return True
    shown = ", ".join(f"{name}={value!r}" for name, value in values.items())
    if strict():
        raise ClaimError(f"the book says {sentence!r}, but this build measured {shown}")
    print(f"注意：书里说“{sentence}”，你这台机器测得的数（{shown}）不支持这句话。书是在另一台机器上"
          f"构建的，机器不同，结论也可能不同；实验照常往下跑。")
    return False


def choose(condition: bool, if_true: str, if_false: str) -> str:
    """The sentence that fits the measurement: ``if_true`` when ``condition`` holds. Both are whole
    sentences, never fragments to assemble."""
    return if_true if condition else if_false


def above_floor(measured_seconds: float, floor, why: str | None = None) -> bool:
    """A measured time against its roofline floor (``minillm.lab.estimate.Floor``): a measurement
    that beats the floor is a claim that fails, unless ``why`` gives the page's explanation in
    numbers (then it is printed with the values)."""
    if measured_seconds >= floor.seconds:
        return True
    if why:
        print(f"实测 {measured_seconds * 1e3:,.2f} ms 低于下界 {floor.seconds * 1e3:,.2f} ms：{why}")
        return False
    return claim(False, "实测时间不低于它的下界 max(F/P, M/W)", measured=measured_seconds,
                 floor=floor.seconds, bound=floor.bound)


def floors_beaten(checks) -> list[str | None]:
    """Each ``(measured, floor, why)`` through :func:`above_floor`: the ``why`` of every one that
    beat its floor (None where nothing explains it), for ``report.beaten_words``."""
    return [why for measured, floor, why in checks if not above_floor(measured, floor, why)]
