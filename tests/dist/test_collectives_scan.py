"""ARCHITECTURE.md invariant 1: torch.distributed is called from one module only, the group's
(dsv4/dist/collectives.py), whose named, deadline-bound collectives the tick issues. An AST scan of
every module of dsv4: any other module that imports torch.distributed (or names it) fails, and no
module at all uses a pickling collective."""

import ast
from pathlib import Path

import dsv4

PACKAGE = Path(dsv4.__file__).parent
COLLECTIVES = PACKAGE / "dist" / "collectives.py"
PICKLING = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
            "send_object_list", "recv_object_list"}


def _names_torch_distributed(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.startswith("torch.distributed") for a in node.names)
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        return module.startswith("torch.distributed") or (
            module == "torch" and any(a.name == "distributed" for a in node.names))
    return isinstance(node, ast.Attribute) and node.attr == "distributed"


def uses_of_torch_distributed(tree: ast.AST) -> list[int]:
    """Line numbers where a module imports or names torch.distributed (torch.distributed.X included)."""
    return [node.lineno for node in ast.walk(tree) if _names_torch_distributed(node)]


def pickling_calls(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute | ast.Name) and getattr(node, "attr", getattr(node, "id", None)) in PICKLING]


def test_only_the_collectives_module_calls_torch_distributed():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        lines = uses_of_torch_distributed(tree)
        if lines and path != COLLECTIVES:
            offenders[str(path.relative_to(PACKAGE))] = lines
        if pickling_calls(tree):
            offenders[f"{path.relative_to(PACKAGE)} (pickling collective)"] = pickling_calls(tree)
    assert not offenders, f"torch.distributed used outside dsv4/dist/collectives.py: {offenders}"
    assert uses_of_torch_distributed(ast.parse(COLLECTIVES.read_text()))  # the scan sees what it looks for


def test_the_scan_catches_every_spelling():
    for source in ("import torch.distributed as dist", "from torch import distributed",
                   "from torch.distributed import all_reduce", "import torch\ntorch.distributed.all_reduce(x)"):
        assert uses_of_torch_distributed(ast.parse(source)), source
    assert pickling_calls(ast.parse("dist.broadcast_object_list(objs)"))
    assert not uses_of_torch_distributed(ast.parse("import torch\ntorch.zeros(1)"))
