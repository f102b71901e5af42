"""The package's layering (docs/architecture.md), enforced: no import runs upward."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "relax"

# Lowest first. A module may import its own component and any lower layer, never a
# sibling in its own layer or anything above.
LAYERS = [
    {"errors", "__init__"},
    {"sample", "config", "targets", "files", "faults", "distributed"},
    {"algo", "task", "logger", "process"},
    {"model"},
    {"replay", "checkpoint"},
    {"rollout", "train"},
    {"debug", "eval"},
    {"cluster"},
    {"loop"},
    {"cli"},
    {"__main__", "entrypoints"},
]
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def component(module: str) -> str:
    """`relax.train.megatron.trainer` -> `train`; `relax` itself -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def relax_imports(path: Path) -> set[str]:
    """Every `relax.*` module a file imports, at top level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "relax":
                found |= {f"relax.{a.name}" for a in node.names}
            elif node.module.startswith("relax."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("relax.")}
    return found


def source_files():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_component_has_a_layer():
    components = {component("relax." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts))
                  for p in source_files()}
    assert components <= LAYER_OF.keys(), components - LAYER_OF.keys()


def test_no_import_runs_upward():
    upward = []
    for path in source_files():
        me = component("relax." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        for module in relax_imports(path):
            other = component(module)
            if other != me and LAYER_OF[other] >= LAYER_OF[me]:
                upward.append(f"{path.relative_to(PACKAGE.parent)} imports {module} "
                              f"(layer {LAYER_OF[other]} >= {LAYER_OF[me]})")
    assert not upward, "\n".join(upward)


def test_the_checker_sees_upward_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from relax.loop import rl_loop\nfrom relax import cli\n")
    assert relax_imports(bad) == {"relax.loop", "relax.cli"}


def test_no_file_over_400_lines():
    files = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]  # code, not shipped weights
    assert len(files) > 40  # the check sees the package
    too_long = {str(p.relative_to(PACKAGE.parent)): n for p in files
                if (n := len(p.read_text().splitlines())) > 400}
    assert not too_long, f"split these (lines): {too_long}"
