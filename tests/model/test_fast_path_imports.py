"""ARCHITECTURE.md invariant 7: the fast paths share no code with the oracle that judges them. An AST
scan of every module of dsv4/model and dsv4/kernels: none imports dsv4.reference, however spelled
(absolute, `from dsv4 import reference`, or relative)."""

import ast
from pathlib import Path

import pytest

import dsv4

PACKAGE = Path(dsv4.__file__).parent
FAST_PATHS = ("model", "kernels")
ORACLE = "dsv4.reference"


def _is_oracle(module: str) -> bool:
    return module == ORACLE or module.startswith(ORACLE + ".")


def oracle_imports(source: str, package: str) -> list[int]:
    """Line numbers of the imports of dsv4.reference in `source`, a module of `package` (e.g. dsv4.model)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `level` dots climb from the module's own package
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parents, *([base] if base else [])])
            modules = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        if any(_is_oracle(module) for module in modules):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("source", [
    "import dsv4.reference",
    "import dsv4.reference.ops as ops",
    "from dsv4.reference.rope import apply_rope",
    "from dsv4.reference import ReferenceModel",
    "from dsv4 import reference",
    "from ..reference.ops import linear",
    "from .. import reference",
])
def test_the_scan_sees_every_spelling(source):
    assert oracle_imports(source, "dsv4.model") == [1]


@pytest.mark.parametrize("source", ["import dsv4.referenced", "from dsv4 import kernels", "from .ops import linear",
                                    "from ..kernels import dispatch"])
def test_the_scan_passes_other_imports(source):
    assert oracle_imports(source, "dsv4.model") == []


def test_model_and_kernels_import_nothing_from_the_reference():
    offenders = {}
    for sub in FAST_PATHS:
        for path in sorted((PACKAGE / sub).rglob("*.py")):
            package = ".".join(["dsv4", *path.relative_to(PACKAGE).parent.parts])
            if lines := oracle_imports(path.read_text(), package):
                offenders[str(path.relative_to(PACKAGE.parent))] = lines
    assert offenders == {}, f"fast-path modules importing {ORACLE}: {offenders}"
