"""Claims checked at build time: a guard fails the build exactly when its sentence is false."""
import pytest

from minillm.lab.claims import ClaimError, above_floor, choose, claim


def test_a_true_claim_passes_and_a_false_one_fails_the_build_naming_the_values(monkeypatch):
    monkeypatch.setenv("MINILLM_STRICT_CLAIMS", "1")
    assert claim(3.2 < 4.0, "the measured step is under the floor's bound", measured=3.2, bound=4.0)
    with pytest.raises(ClaimError, match=r"the book says 'the fix shortens the mean end-to-end time'.*before=1815.8, after=1829.0"):
        claim(1829.0 < 1815.8, "the fix shortens the mean end-to-end time", before=1815.8, after=1829.0)


def test_outside_the_build_a_false_claim_prints_a_note_and_the_lab_goes_on(monkeypatch, capsys):
    monkeypatch.delenv("MINILLM_STRICT_CLAIMS", raising=False)
    assert claim(1829.0 < 1815.8, "修复让平均端到端时间变短", before=1815.8, after=1829.0) is False
    note = capsys.readouterr().out
    assert "修复让平均端到端时间变短" in note and "before=1815.8" in note and "另一台机器" in note


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


def test_a_measurement_below_its_floor_needs_an_explanation(monkeypatch, capsys):
    from minillm.lab.estimate import roofline_floor

    monkeypatch.setenv("MINILLM_STRICT_CLAIMS", "1")
    floor = roofline_floor(2e9, 1e8, 1e12, 1e11)  # 2 ms to compute, 1 ms to read: compute-bound
    assert above_floor(0.0025, floor)
    with pytest.raises(ClaimError, match="bound='compute'"):
        above_floor(0.0015, floor)
    assert above_floor(0.0015, floor, why="the probe measured one square matmul") is False
    assert "the probe measured one square matmul" in capsys.readouterr().out
