"""Hand the labs nbmake just executed to the book build's execution cache, so each runs once.

scripts/test.sh runs nbmake with --overwrite on copies of notebooks/*.ipynb under .labs/ (nbmake
skips any path under _build); this puts each copy's outputs into the jupyter-cache that
`jupyter-book build` (execute_notebooks: cache) reads, keyed by the lab's source as it is in
notebooks/. A lab whose source has changed since has no entry, and the book build runs it itself.

    python scripts/cache_labs.py .labs [_build/.jupyter_cache]
"""

import sys
from pathlib import Path

import nbformat
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn

REPO = Path(__file__).resolve().parents[1]


def cache_lab(cache, executed_path: Path, source_path: Path) -> None:
    """Cache the source notebook with the executed copy's outputs (its cell metadata unchanged:
    the cache hashes it, and nbmake adds timings to it)."""
    source = nbformat.read(source_path, as_version=4)
    executed = nbformat.read(executed_path, as_version=4)
    source_code = [c for c in source.cells if c.cell_type == "code"]
    executed_code = [c for c in executed.cells if c.cell_type == "code"]
    if [c.source for c in source_code] != [c.source for c in executed_code]:
        print(f"{source_path.name}: changed since nbmake ran it, left to the book build")
        return
    for cell, done in zip(source_code, executed_code):
        cell.outputs, cell.execution_count = done.outputs, done.execution_count
    for key in ("language_info", "widgets"):
        if key in executed.metadata:
            source.metadata[key] = executed.metadata[key]
    uri = str(source_path.resolve())
    cache.cache_notebook_bundle(CacheBundleIn(source, uri), check_validity=False, overwrite=True)
    print(f"{source_path.name}: cached for the book build")


def main(executed_dir: str, cache_dir: str = str(REPO / "_build" / ".jupyter_cache")) -> None:
    cache = get_cache(cache_dir)
    for executed_path in sorted(Path(executed_dir).glob("*.ipynb")):
        cache_lab(cache, executed_path, REPO / "notebooks" / executed_path.name)


if __name__ == "__main__":
    main(*sys.argv[1:])
