"""Run each lab once per build and hand its outputs to the book build's execution cache.

The chapter pages read what their labs saved (``_build/results/<lab>.json``, minillm/lab/results.py),
so every lab must have run before the pages are built, and once only: the book build
(execute_notebooks: cache) then takes each lab's outputs from the jupyter-cache, keyed by the lab's
source as it is in notebooks/.

    python scripts/cache_labs.py .labs    # scripts/test.sh: cache the copies nbmake just executed
    python scripts/cache_labs.py --run    # scripts/book.sh: execute every lab the cache lacks
"""

import sys
from pathlib import Path

import nbformat
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "_build" / ".jupyter_cache"
RESULTS = REPO / "_build" / "results"
CELL_TIMEOUT = 900  # seconds, as nbmake's in scripts/test.sh


def cache_lab(cache, executed_path: Path, source_path: Path) -> None:
    """Cache the source notebook with the executed copy's outputs (its cell metadata unchanged:
    the cache hashes it, and nbmake adds timings to it)."""
    source = nbformat.read(source_path, as_version=4)
    executed = nbformat.read(executed_path, as_version=4)
    source_code = [c for c in source.cells if c.cell_type == "code"]
    executed_code = [c for c in executed.cells if c.cell_type == "code"]
    if [c.source for c in source_code] != [c.source for c in executed_code]:
        print(f"{source_path.name}: changed since it was executed, left to the book build")
        return
    for cell, done in zip(source_code, executed_code):
        cell.outputs, cell.execution_count = done.outputs, done.execution_count
    for key in ("language_info", "widgets"):
        if key in executed.metadata:
            source.metadata[key] = executed.metadata[key]
    uri = str(source_path.resolve())
    cache.cache_notebook_bundle(CacheBundleIn(source, uri), check_validity=False, overwrite=True)
    print(f"{source_path.name}: cached for the book build")


def cached(cache, source_path: Path) -> bool:
    """Whether the cache holds this lab's current source and the results file it saves exists."""
    nb = nbformat.read(source_path, as_version=4)
    try:
        cache.match_cache_notebook(nb)
    except KeyError:
        return False
    saves = any("lab.finish()" in c.source for c in nb.cells if c.cell_type == "code")
    return not saves or (RESULTS / f"{source_path.stem}.json").is_file()


def run_missing(cache) -> None:
    """Execute (in notebooks/, as a reader would) every lab the cache lacks, and cache it."""
    from nbclient import NotebookClient

    for source_path in sorted((REPO / "notebooks").glob("*.ipynb")):
        if cached(cache, source_path):
            continue
        print(f"{source_path.name}: running", flush=True)
        nb = nbformat.read(source_path, as_version=4)
        NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                       resources={"metadata": {"path": str(source_path.parent)}}).execute()
        executed = RESULTS / "executed" / source_path.name
        executed.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, executed)
        cache_lab(cache, executed, source_path)


def main(argv: list[str]) -> None:
    cache = get_cache(str(CACHE))
    if argv == ["--run"]:
        run_missing(cache)
        return
    for executed_path in sorted(Path(argv[0]).glob("*.ipynb")):
        cache_lab(cache, executed_path, REPO / "notebooks" / executed_path.name)


if __name__ == "__main__":
    main(sys.argv[1:])
