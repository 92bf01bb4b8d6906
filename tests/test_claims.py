"""Claims checked at build time: a guard fails the build exactly when its sentence is false."""
import pytest

from minillm.lab.claims import ClaimError, choose, claim


def test_a_true_claim_passes_and_a_false_one_fails_naming_the_values():
    claim(3.2 < 4.0, "the measured step is under the floor's bound", measured=3.2, bound=4.0)
    with pytest.raises(ClaimError, match=r"the book says 'the fix shortens the mean end-to-end time'.*before=1815.8, after=1829.0"):
        claim(1829.0 < 1815.8, "the fix shortens the mean end-to-end time", before=1815.8, after=1829.0)


def test_choose_picks_the_wording_that_fits():
    assert choose(1829.0 < 1815.8, "更短", "反而更长") == "反而更长"
    assert choose(1.2 < 1.5, "更短", "反而更长") == "更短"


def test_a_failing_guard_fails_the_book_build():
    """A ClaimError in any page's or lab's cell must stop `jupyter-book build`, not land in the page."""
    from pathlib import Path

    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "_config.yml").read_text(encoding="utf-8"))
    assert config["execute"]["allow_errors"] is False
    assert config["execute"]["execute_notebooks"] in ("cache", "force", "auto")
    assert config["sphinx"]["config"]["nb_execution_raise_on_error"] is True
