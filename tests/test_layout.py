"""The package's layout: the engine stands alone, the ledger needs no torch, one function builds the
attention metadata, and the labs share one setup instead of copies."""
import ast
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "minillm" / "engine"
NOT_FOR_THE_ENGINE = ("minillm.lab", "minillm.server", "matplotlib", "myst_nb", "ipywidgets", "IPython")
PURE_PYTHON = ("minillm.lab.estimate", "minillm.lab.gpus", "minillm.engine.engine_config",
               "minillm.engine.memory_plan", "minillm.engine.paging")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth of the file (``from a import b`` gives a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", sorted(ENGINE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_engine_imports_neither_the_kit_nor_the_book_stack(path):
    bad = [m for m in imported_modules(path) if m.startswith(NOT_FOR_THE_ENGINE)]
    assert not bad, f"{path.name} imports {bad}"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles(paths, root: Path = ROOT) -> list[list[str]]:
    """The import cycles among these files (any import, at any depth: a lazy import inside a function
    closes a cycle too): the strongly connected components of more than one module, or a module
    that imports itself, each sorted (Tarjan's algorithm)."""
    modules = {module_name(p, root): p for p in paths}
    graph = {name: sorted(m for m in imported_modules(path) if m in modules)
             for name, path in modules.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(name):
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for other in graph[name]:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in on_stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while not component or component[-1] != name:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or name in graph[name]:
                cycles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return sorted(cycles)


def test_import_cycles_are_found(tmp_path):
    """The finder on a made-up package: a -> b -> c -> a (c's import lazy) is one cycle, d stands apart."""
    package = tmp_path / "minillm" / "fake"
    package.mkdir(parents=True)
    (package / "a.py").write_text("from minillm.fake.b import x\n")
    (package / "b.py").write_text("import minillm.fake.c\n")
    (package / "c.py").write_text("def f():\n    from minillm.fake import a\n")
    (package / "d.py").write_text("from minillm.fake.a import y\n")
    assert import_cycles(sorted(package.glob("*.py")), tmp_path) == [
        ["minillm.fake.a", "minillm.fake.b", "minillm.fake.c"]]


def test_minillm_has_no_import_cycles():
    assert import_cycles(sorted((ROOT / "minillm").rglob("*.py"))) == []


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)


def test_the_engine_loads_without_the_book_stack():
    engine_modules = sorted("minillm.engine." + ".".join(p.relative_to(ENGINE).with_suffix("").parts)
                            for p in ENGINE.rglob("*.py") if p.name != "__init__.py")
    code = (f"import importlib, sys\nfor m in {engine_modules!r}: importlib.import_module(m)\n"
            f"import minillm\nminillm.LLM, minillm.generate\n"
            f"print(sorted(m for m in sys.modules if m.startswith({NOT_FOR_THE_ENGINE!r})))")
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_ledger_imports_where_there_is_no_torch():
    """A finder that refuses torch: the ledger, the spec table and the pure settings still import."""
    code = ("import sys\nclass NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'triton', 'numpy'): raise ImportError('no ' + name)\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            f"import importlib\nfor m in {PURE_PYTHON!r}: importlib.import_module(m)\n"
            "import minillm\nfrom minillm.lab import estimate\nfrom minillm.engine.config import load_config\n"
            "print(estimate.fmt_int(estimate.memory_budget(load_config('llama-3.1-8b'), '24GiB').tokens))")
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "58,347"
    assert "torch" in run_python("from minillm import LLM; import sys; print(sorted(sys.modules))").stdout


def test_attention_metadata_is_built_in_one_function():
    builders = []
    for path in sorted((ROOT / "minillm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            for func in (n for n in ast.walk(node) if isinstance(n, ast.FunctionDef)):
                if any(isinstance(c, ast.Call) and getattr(c.func, "id", None) == "AttentionMetadata"
                       for c in ast.walk(func)):
                    builders.append(f"{path.name}:{func.name}")
    assert sorted(set(builders)) == ["attention_metadata.py:build"]


def test_block_size_is_validated_only_in_engine_config():
    """``EngineConfig`` checks ``block_size`` once; the caches and the indexes take it as given."""
    from minillm.engine.engine_config import EngineConfig

    elsewhere = sorted(f"{path.name}:{node.lineno}" for path in (ROOT / "minillm").rglob("*.py")
                       if path.name != "engine_config.py" for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_positive_int"
                       and "block_size" in ast.unparse(node.args[0]))
    assert elsewhere == []
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        EngineConfig(block_size=0)


def notebook_code(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_labs_start_with_the_one_setup_and_read_no_environment(path):
    code = notebook_code(path)
    assert "setup(" in code and "from minillm.lab.notebook import" in code
    for forbidden in ("os.environ", "getenv", "MINILLM_", "set_num_threads"):
        assert forbidden not in code, f"{path.name} uses {forbidden}"


def test_no_function_is_defined_in_two_labs():
    defined = Counter()
    for path in NOTEBOOKS:
        defined.update(set(re.findall(r"^def (\w+)\(", notebook_code(path), re.M)))
    twins = sorted(name for name, count in defined.items() if count > 1)
    assert not twins, f"defined in more than one lab: {twins} (move them to minillm/lab/notebook.py)"
