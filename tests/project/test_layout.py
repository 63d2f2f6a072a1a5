"""The layout is the architecture: every import runs downward through the layers below,
from the kernels the rewritten programs call, through the passes, to the API."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"fxtp": "fxtp", "fxtp.passes": "passes"}

LAYERS = [
    {"fxtp.kernels"},
    {"fxtp.passes"},
    {"fxtp.frontend"},
    {"fxtp.plans"},
    {"fxtp.edges"},
    {"fxtp.runtime", "fxtp.inspection"},
    {"fxtp.planning"},
    {"fxtp.pipeline"},
    {"fxtp.compiling", "fxtp.serving", "fxtp.examples"},
    {"fxtp.cli"},
    {"fxtp.__main__"},
]
"""Bottom to top. A module imports from its own package and from lower layers only."""


def modules():
    """``(dotted name, is a package, path)`` of every module fxtp installs."""
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if package == "fxtp" and parts[0] == "passes":
                continue
            is_package = parts[-1] == "__init__"
            yield ".".join((package,) + (parts[:-1] if is_package else parts)), is_package, path


def imported(name: str, is_package: bool, path: Path):
    """The fxtp modules (or packages) ``path`` imports, relative imports resolved."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            yield from ([f"{target}.{a.name}" for a in node.names] if target.count(".") < 1
                        else [target])
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def layer(module: str):
    """The index in :data:`LAYERS` of the unit holding ``module``; ``None`` for the root
    package (its ``__init__`` loads names lazily)."""
    for i, units in enumerate(LAYERS):
        if any(module == u or module.startswith(u + ".") for u in units):
            return i
    return None


def unit(module: str) -> str:
    return next(u for units in LAYERS for u in units
                if module == u or module.startswith(u + "."))


ALL = [m for m in modules() if m[0] != "fxtp"]


@pytest.mark.parametrize("name,is_package,path", ALL, ids=[m[0] for m in ALL])
def test_imports_run_downward(name, is_package, path):
    upward = [target for target in imported(name, is_package, path)
              if target.startswith("fxtp.") and layer(target) is not None
              and unit(target) != unit(name) and layer(target) >= layer(name)]
    assert upward == [], f"{name} imports from its own layer or above"


def test_every_module_has_a_layer():
    assert [name for name, _, _ in ALL if layer(name) is None] == []


def test_the_kernels_stand_on_torch_alone():
    """The run-time kernels import nothing from the passes or the API: a rewritten program
    saved as code needs only ``fxtp.kernels``."""
    kernels = [(n, p, path) for n, p, path in ALL if n.startswith("fxtp.kernels")]
    assert len(kernels) >= 6
    for name, is_package, path in kernels:
        assert all(t.startswith("fxtp.kernels") for t in imported(name, is_package, path)
                   if t.startswith("fxtp")), name
