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


BOUND_WORDS = {"compute": "算力", "memory": "带宽"}


def floor_words(floor) -> str:
    """A ``minillm.lab.estimate.Floor`` as the book writes it: the time and the ceiling that binds,
    e.g. ``≥ 2.7 ms（算力：F/P）``."""
    side = "F/P" if floor.bound == "compute" else "M/W"
    return f"≥ {floor.seconds * 1e3:,.2f} ms（{BOUND_WORDS[floor.bound]}：{side}）"


def show_answer(text: str):
    """A real model's answer, quoted as English (``lang="en"``) on the book's Chinese pages."""
    import html

    from IPython.display import HTML, display

    display(HTML(f'<blockquote lang="en">{html.escape(text).replace(chr(10), "<br/>")}</blockquote>'))


def show_english(text: str):
    """Verbatim English (a command's report, JSON on the wire) as a block marked ``lang="en"``."""
    import html

    from IPython.display import HTML, display

    display(HTML(f'<pre lang="en">{html.escape(text)}</pre>'))
