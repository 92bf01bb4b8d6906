"""The book's sentences about measurements, as data (all chapters).

``book/claims.yml`` lists, lab by lab, every sentence a page (or a lab's own text) writes about what
the lab measured, with an expression over the values that lab recorded (``Results.record``) that
must hold for the sentence to be true. Each lab checks its claims when it finishes, and each page
checks them again when it is built. In the book build (``MINILLM_STRICT_CLAIMS=1``, which
``scripts/book.sh`` and ``scripts/test.sh`` set) a claim the numbers do not support fails the build,
so a reader never meets prose that the measurements beside it contradict. In a reader's own run, on
another machine, the lab prints which sentences this machine's numbers do not bear out, and goes on.

Claims keep to what the physics guarantees (B = 1 decode reads more bytes than it computes FLOPs);
a sentence that would only narrate noise does not belong in the book.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

STRICT = "MINILLM_STRICT_CLAIMS"
CLAIMS_FILE = Path(__file__).resolve().parents[2] / "book" / "claims.yml"
# What an expression may call besides the recorded values.
SAFE = {f.__name__: f for f in (abs, all, any, len, max, min, round, sorted, sum, zip, range)}


class ClaimError(AssertionError):
    """A sentence of the book no longer holds for the numbers this build measured."""


@dataclass(frozen=True)
class Claim:
    """One sentence of the book about lab ``lab``'s results, and the expression that guards it."""

    lab: str
    id: str
    expr: str
    sentence: str

    def holds(self, values: dict) -> bool:
        """Evaluate the expression with the recorded values as its names."""
        try:
            return bool(eval(self.expr, {"__builtins__": SAFE, **values}))  # noqa: S307 (the book's own file)
        except (NameError, KeyError, IndexError, TypeError) as e:
            raise ClaimError(f"claim {self.lab}/{self.id} cannot be checked: {e!r} "
                             f"(does the lab record what {self.expr!r} reads?)") from e


def strict() -> bool:
    """True in the book build: a false claim raises instead of printing a note."""
    return os.environ.get(STRICT, "").strip().lower() in ("1", "true", "yes", "on")


def load_claims(path: Path = CLAIMS_FILE) -> list[Claim]:
    """Every claim of the book, in file order."""
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    return [Claim(lab, row["id"], row["expr"], row["sentence"])
            for lab, rows in data.items() for row in rows]


def check(lab: str, values: dict, path: Path = CLAIMS_FILE) -> list[tuple[Claim, bool]]:
    """Check lab ``lab``'s claims against its recorded ``values``: (claim, holds) for each. A false
    one raises ``ClaimError`` in the book build and prints a note anywhere else."""
    if not Path(path).is_file():  # minillm used outside the book's repository
        return []
    verdicts = [(c, c.holds(values)) for c in load_claims(path) if c.lab == lab]
    false = [c for c, ok in verdicts if not ok]
    if false and strict():
        raise ClaimError("this build's measurements do not support: " + "; ".join(
            f"{c.id} ({c.sentence!r}, checked by {c.expr!r})" for c in false))
    for c in false:
        print(f"注意：书里说“{c.sentence}”，你这台机器测得的数不支持这句话（{c.id}：{c.expr}）。"
              "书是在另一台机器上构建的，机器不同，结论也可能不同；实验照常往下跑。")
    return verdicts
