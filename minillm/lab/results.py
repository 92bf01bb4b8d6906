"""What a lab measured, kept for its chapter page (all chapters).

A lab shows its tables and figures as it runs and keeps them, with the raw values its claims need,
in one results file per lab: ``_build/results/<lab>.json`` (figures beside it as PNG files). The
chapter page reads that file, so page and lab quote one measurement: the page shows the lab's
tables and figures whole, and every sentence it writes about them is a row of ``book/claims.yml``,
checked against these values (``minillm.lab.claims``) when the lab finishes and again when the page
is built.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from minillm.lab.machine_profile import PROFILE_DIR
from minillm.lab.report import markdown_table

RESULTS_DIR = PROFILE_DIR / "results"


@dataclass
class Results:
    """The tables, figures and values of one lab's run on one machine."""

    lab: str  # the lab's file name without .ipynb, e.g. "ch04-decode"
    values: dict = field(default_factory=dict)
    tables: dict[str, list] = field(default_factory=dict)  # name -> [header, rows], cells as shown
    figures: list[str] = field(default_factory=list)
    directory: Path = RESULTS_DIR

    @property
    def path(self) -> Path:
        return Path(self.directory) / f"{self.lab}.json"

    def figure_path(self, name: str) -> Path:
        return Path(self.directory) / self.lab / f"{name}.png"

    # --- the lab's side ---------------------------------------------------------------------------

    def record(self, **values) -> None:
        """Keep raw values (numbers, strings, lists, dicts) for the claims and the page."""
        json.dumps(values)  # fails here, not at save time, on a value JSON cannot hold
        self.values.update(values)

    def add_table(self, name: str, header: list[str], rows: list[list]) -> None:
        """Show a table in the lab and keep it, cells as shown, for the page."""
        self.tables[name] = [list(map(str, header)), [[str(cell) for cell in row] for row in rows]]
        self.table(name)

    def add_figure(self, name: str, fig) -> None:
        """Keep a matplotlib figure for the page, as the lab shows it (PNG at the figure's dpi)."""
        path = self.figure_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=fig.dpi)
        if name not in self.figures:
            self.figures.append(name)

    def save(self, **about) -> Path:
        """Write the results file; ``about`` says what ran (device, model, threads)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"lab": self.lab, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "about": about, "values": self.values, "tables": self.tables, "figures": self.figures}
        self.path.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
        return self.path

    # --- the page's side --------------------------------------------------------------------------

    def __getitem__(self, name: str):
        return self.values[name]

    def table(self, name: str) -> None:
        """Display a kept table (a Markdown table in JupyterLab and in the book)."""
        from IPython.display import Markdown, display

        header, rows = self.tables[name]
        display(Markdown(markdown_table(header, rows)))

    def show_figure(self, name: str) -> None:
        """Display a kept figure."""
        from IPython.display import Image, display

        display(Image(filename=str(self.figure_path(name))))


def load(lab: str, directory: Path = RESULTS_DIR) -> Results:
    """The results ``notebooks/<lab>.ipynb`` saved in this build, its claims checked again."""
    from minillm.lab.claims import check

    path = Path(directory) / f"{lab}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the lab notebooks/{lab}.ipynb first "
                                "(scripts/book.sh runs every lab before it builds the pages)")
    data = json.loads(path.read_text(encoding="utf-8"))
    results = Results(lab, data["values"], data["tables"], data["figures"], Path(directory))
    check(lab, results.values)
    return results
