"""Sentences whose truth depends on a measurement (all chapters).

A page may state what a measurement shows only in one of two ways: the wording is chosen by code
from the values (:func:`choose`), or the sentence is written out and guarded by :func:`claim`, which
fails the build when the values no longer support it. Either way a reader never meets prose that
its own glued numbers contradict.
"""
from __future__ import annotations


class ClaimError(AssertionError):
    """A sentence of the book no longer holds for the numbers this build measured."""


def claim(holds: bool, sentence: str, **values) -> None:
    """Fail the build unless ``holds``: the book says ``sentence`` about ``values``."""
    if not holds:
        shown = ", ".join(f"{name}={value!r}" for name, value in values.items())
        raise ClaimError(f"the book says {sentence!r}, but this build measured {shown}")


def choose(condition: bool, if_true: str, if_false: str) -> str:
    """The wording that fits the measurement: ``if_true`` when ``condition`` holds."""
    return if_true if condition else if_false
