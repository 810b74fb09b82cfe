"""The accelerate surface uses the Engine's and the backend's declared interfaces only.

`ds_engine/accelerator.py` and `ds_engine/accelerate_compat/` are read as source: no private
Engine member (an underscore name the Engine class or an Engine defines), no backend attribute
the `Backend` base class does not declare, no private name imported from another ds_engine
module, no import of `ds_engine.backends`, and no test of which backend runs
(`backend_name == "deepspeed"`): the backend's declared capabilities say what differs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ds_engine
from ds_engine.backends.base import Backend
from ds_engine.engine import Engine

PACKAGE = Path(ds_engine.__file__).resolve().parent
SURFACE = [PACKAGE / "accelerator.py", *sorted((PACKAGE / "accelerate_compat").glob("*.py"))]


#: Reach-ins still needed, each with the line it may appear on once: none. The Accelerator reads
#: the backend through the Engine's `backend_capabilities` in one property
#: (`_backend_capabilities`); every use of that property is checked against what `Backend` declares.
ALLOWED_ONCE: set[tuple[str, str]] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@pytest.fixture(scope="module")
def engine_privates() -> set[str]:
    """Every underscore name of the Engine: its class, an instance, and `self._x` in its module."""
    names = {n for n in dir(Engine) if _private(n)}
    engine = Engine(backend="accelerate")
    try:
        names |= {n for n in vars(engine) if _private(n)}
    finally:
        engine.end_training()
    source = Path(Engine.__module__.replace(".", "/") + ".py")
    tree = ast.parse((PACKAGE.parent / source).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and ast.unparse(node.value) == "self":
            names.add(node.attr)
    return names


def _declared_backend_names() -> set[str]:
    return {n for n in dir(Backend) if not n.startswith("_")}


def _is_backend(node: ast.AST) -> bool:
    """An expression that names a backend object (`backend`, `self._backend`,
    `self._backend_capabilities`, ...), not `backend_name`."""
    if isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Attribute):
        name = node.attr
    else:
        return False
    return "backend" in name and name != "backend_name"


def _problems(path: Path, engine_privates: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[str] = []
    declared = _declared_backend_names()
    for node in ast.walk(tree):
        where = f"{path.parent.name}/{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute):
            if node.attr in engine_privates:
                found.append(f"{where}: private Engine member `{node.attr}`")
            if _is_backend(node.value) and node.attr not in declared:
                found.append(f"{where}: backend attribute `{node.attr}` the Backend base does not declare")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id
            in (
                "getattr",
                "hasattr",
                "setattr",
            )
        ):
            if node.args and _is_backend(node.args[0]):
                found.append(f"{where}: `{node.func.id}` on the backend (probing an undeclared attribute)")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ds_engine"):
            if node.module.startswith("ds_engine.backends"):
                found.append(
                    f"{where}: imports {node.module} (use the Engine's and Backend's declared names)"
                )
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where}: imports the private `{alias.name}` from {node.module}")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            names_backend = any(isinstance(o, ast.Attribute) and o.attr == "backend_name" for o in operands)
            says_deepspeed = any(isinstance(o, ast.Constant) and o.value == "deepspeed" for o in operands)
            if names_backend or says_deepspeed:
                found.append(f"{where}: tests which backend runs (use a declared capability)")
    return found


def test_the_accelerate_surface_uses_declared_interfaces_only(engine_privates):
    assert len(SURFACE) > 2, SURFACE
    problems = [p for path in SURFACE for p in _problems(path, engine_privates)]
    for file, what in ALLOWED_ONCE:
        allowed = [p for p in problems if p.startswith(f"{file}:") and p.endswith(what)]
        assert len(allowed) <= 1, allowed
        problems = [p for p in problems if p not in allowed]
    assert not problems, "\n".join(problems)


def test_the_check_finds_what_it_looks_for(tmp_path, engine_privates):
    """Each kind of reach-in the check guards against is found in a file that has it."""
    sample = tmp_path / "reach_in.py"
    text = (
        "from ds_engine.engine import _is_scheduler\n"
        "from ds_engine.backends.base import Backend\n"
        "def f(self):\n"
        "    self._backend.ds_engine = None\n"
        "    self.backend.fsdp\n"
        "    self._backend_capabilities.accelerator\n"
        "    getattr(self.backend, 'accelerator', None)\n"
        "    return self._model, self.backend_name == 'deepspeed'\n"
    )
    sample.write_text(text, encoding="utf-8")
    problems = "\n".join(_problems(sample, engine_privates))
    for expected in (
        "private `_is_scheduler`",
        "imports ds_engine.backends.base",
        "private Engine member `_backend`",
        "backend attribute `ds_engine`",
        "backend attribute `fsdp`",
        "backend attribute `accelerator`",
        "`getattr` on the backend",
        "private Engine member `_model`",
        "tests which backend runs",
    ):
        assert expected in problems, (expected, problems)
