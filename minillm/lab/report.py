"""Tables for the book's pages and labs: every lab ends in "estimate | measured here | recorded on GPU".

A recorded GPU number is only ever read from ``data/measurements/*.json`` (``minillm.lab.records``),
the files that ``python -m minillm bench`` writes; when there is none, the cell says so plainly.
"""
from __future__ import annotations

NOT_RECORDED = "尚未在 GPU 上记录"


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table; cells are printed with ``str``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def show_table(header: list[str], rows: list[list]):
    """Display a Markdown table in a notebook (renders in JupyterLab and in the built book)."""
    from IPython.display import Markdown, display

    display(Markdown(markdown_table(header, rows)))


COMPARISON_HEADER = ["量", "估算", "本机实测", "GPU 记录"]


def comparison_table(rows: list[tuple[str, str, str, str | None]]):
    """The lab's closing table: (quantity, estimate, measured here, recorded on GPU or None)."""
    show_table(COMPARISON_HEADER, [[q, e, m, r if r is not None else NOT_RECORDED]
                                   for q, e, m, r in rows])
