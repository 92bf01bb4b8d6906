"""The claims table (book/claims.yml): every row is well formed, guards a sentence that stands word
for word in its page or lab, and the check fails in the build and only notes in a reader's run."""
import json
import re
from pathlib import Path

import pytest

from minillm.lab import claims
from minillm.lab.results import Results, load

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = claims.load_claims()


def lab_text(lab: str) -> str:
    """The page and the lab's markdown, where a claimed sentence may stand."""
    page = (ROOT / "book" / f"{lab}.md").read_text(encoding="utf-8")
    cells = json.loads((ROOT / "notebooks" / f"{lab}.ipynb").read_text(encoding="utf-8"))["cells"]
    return page + "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_claims_are_well_formed():
    assert CLAIMS, "book/claims.yml lists no claims"
    ids = [(c.lab, c.id) for c in CLAIMS]
    assert len(ids) == len(set(ids)), "a claim id is used twice in one lab"
    for c in CLAIMS:
        assert (ROOT / "notebooks" / f"{c.lab}.ipynb").is_file(), f"{c.lab}: no such lab"
        assert re.fullmatch(r"[a-z0-9-]+", c.id), c.id
        compile(c.expr, c.id, "eval")
        assert re.search(r"[\u4e00-\u9fff]", c.sentence), f"{c.id}: the sentence is not the book's"


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: f"{c.lab}/{c.id}")
def test_each_claimed_sentence_stands_in_its_page_or_lab(claim):
    assert claim.sentence in lab_text(claim.lab), (
        f"{claim.lab}/{claim.id}: {claim.sentence!r} is not written word for word in "
        f"book/{claim.lab}.md or its lab")


def test_a_false_claim_raises_in_the_build_and_notes_elsewhere(tmp_path, monkeypatch, capsys):
    table = tmp_path / "claims.yml"
    table.write_text("demo:\n  - id: fast\n    expr: seconds < limit\n    sentence: 一步不到一毫秒\n", encoding="utf-8")
    monkeypatch.setenv(claims.STRICT, "1")
    assert claims.check("demo", {"seconds": 0.5, "limit": 1.0}, table)[0][1] is True
    with pytest.raises(claims.ClaimError, match="fast"):
        claims.check("demo", {"seconds": 2.0, "limit": 1.0}, table)
    with pytest.raises(claims.ClaimError, match="cannot be checked"):
        claims.check("demo", {"seconds": 2.0}, table)  # the lab did not record what the claim reads
    monkeypatch.delenv(claims.STRICT)
    assert claims.check("demo", {"seconds": 2.0, "limit": 1.0}, table)[0][1] is False
    assert "一步不到一毫秒" in capsys.readouterr().out
    assert claims.check("other", {}, table) == []


def test_expressions_see_the_values_and_a_few_builtins_only():
    claim = claims.Claim("demo", "x", "all(p['s'] >= p['f'] for p in points) and max(n) == 3", "句子")
    assert claim.holds({"points": [{"s": 2, "f": 1}], "n": [1, 3]})
    with pytest.raises(claims.ClaimError):
        claims.Claim("demo", "x", "__import__('os')", "句子").holds({})


def test_results_round_trip_through_the_file(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(claims, "CLAIMS_FILE", tmp_path / "none.yml")  # no claims for "demo"
    kept = Results("demo", directory=tmp_path)
    kept.record(steps=[{"batch": 1, "seconds": 0.25}])
    kept.tables["t"] = [["B", "实测"], [["1", "250 ms"]]]
    fig, ax = plt.subplots()
    kept.add_figure("f", fig)
    kept.save(device="cpu")
    back = load("demo", tmp_path)
    assert back["steps"] == [{"batch": 1, "seconds": 0.25}] and back.tables == kept.tables
    assert back.figures == ["f"] and back.figure_path("f").is_file()
    with pytest.raises(TypeError):
        kept.record(bad=object())  # fails when recorded, not when saved
    with pytest.raises(FileNotFoundError, match="run the lab"):
        load("missing", tmp_path)
