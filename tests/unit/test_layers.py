"""The config modules form layers: each imports only modules below it (no import circle, also
not through TYPE_CHECKING or function-level imports), and none grows past ~700 lines; the
memory estimator's modules layer the same way and stay as small."""

from __future__ import annotations

import ast
from pathlib import Path

import ds_engine

PACKAGE = Path(ds_engine.__file__).resolve().parent

#: Bottom first: a module may import only those listed before it (and nothing of ds_engine else).
LAYERS = ["_values", "errors", "ds_blocks", "ds_schema", "config_rules", "config", "ds_config"]


def _ds_engine_imports(path: Path) -> set[str]:
    """Every ds_engine module `path` imports, anywhere in the file (`ds_engine.x` -> "x")."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "ds_engine" and len(parts) > 1 and (PACKAGE / f"{parts[1]}.py").exists():
                found.add(parts[1])
    return found


#: Leaves any layer may use: they import nothing of ds_engine.
LEAVES = {"_imports"}

#: The memory estimator, bottom first, on top of `_values`: `ds_engine.memory` is its public face.
ESTIMATOR = ["_memory_types", "_memory_peak", "_model_shapes", "memory"]

#: Saving and loading weights and checkpoints, bottom first (`_version` is a leaf they may use).
SAVING = [
    "_values",
    "safety",
    "_io",
    "_async_save",
    "_folders",
    "_safetensors",
    "_gather",
    "_weight_names",
    "weights",
    "manifest",
    "_checkpoint_state",
    "consolidate",
    "checkpoint",
    "preemption",
]
#: Saving modules above the Engine (they import it), capped like the others.
SAVING_TOP = ["autosave"]

#: Most lines a module of the layers above may have.
MAX_LINES = 700


def test_each_config_layer_imports_only_layers_below_it():
    for leaf in LEAVES:
        assert not _ds_engine_imports(PACKAGE / f"{leaf}.py") - {leaf}, leaf
    for i, name in enumerate(LAYERS):
        allowed = set(LAYERS[:i]) | LEAVES
        imported = _ds_engine_imports(PACKAGE / f"{name}.py") - {name}
        assert imported <= allowed, (name, sorted(imported - allowed))


def test_estimator_modules_import_only_modules_below_them():
    for i, name in enumerate(ESTIMATOR):
        allowed = {"_values", *ESTIMATOR[:i]}
        imported = _ds_engine_imports(PACKAGE / f"{name}.py") - {name}
        assert imported <= allowed, (name, sorted(imported - allowed))


def test_saving_modules_import_only_modules_below_them():
    for i, name in enumerate(SAVING):
        allowed = {"_version", *SAVING[:i]}
        imported = _ds_engine_imports(PACKAGE / f"{name}.py") - {name}
        assert imported <= allowed, (name, sorted(imported - allowed))


def test_config_and_estimator_modules_stay_small():
    for name in LAYERS + ESTIMATOR + SAVING + SAVING_TOP:
        lines = len((PACKAGE / f"{name}.py").read_text(encoding="utf-8").splitlines())
        assert lines <= MAX_LINES, (name, lines)


def test_the_public_names_stay_where_they_were():
    from ds_engine import config, ds_config

    for name in (
        "EngineConfig",
        "ConfigError",
        "resolve_engine_config",
        "load_json_config",
        "STEPS_PER_PRINT_OFF",
    ):
        assert hasattr(config, name), name
    for name in (
        "build_ds_config",
        "load_base",
        "preset_path",
        "validate_ds_config",
        "hidden_size_from_model",
        "deepspeed_bucket_fallbacks",
        "DEEPSPEED_SCHEDULERS",
        "PRESETS",
        "PRESETS_DIR",
        "preset_choices",
        "render_presets",
    ):
        assert hasattr(ds_config, name), name
    for name in ds_engine.__all__:
        assert getattr(ds_engine, name) is not None, name


# ---------------------------------------------------------------- the accelerate surface
#: `ds_engine/accelerate_compat/`, bottom first: each module imports only the package's modules
#: before it and the ds_engine modules named beside it; `ds_engine/accelerator.py` re-exports it.
ACCELERATE_COMPAT = {
    "compat": set(),
    "constructor": set(),
    "trackers": {"tracking"},
    "state_folders": {"_io", "autosave", "checkpoint"},
    "views": {"engine"},
    "accelerator": {"engine", "dataloader", "scheduler", "collectives", "config", "autosave"},
}
ACCELERATE_COMPAT_DIR = PACKAGE / "accelerate_compat"


def _accelerate_compat_imports(path: Path) -> tuple[set[str], set[str]]:
    """(package modules, other ds_engine modules) `path` imports, anywhere in the file."""
    inside: set[str] = set()
    outside: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "ds_engine" or len(parts) < 2:
                continue
            if parts[1] == "accelerate_compat":
                if len(parts) > 2 and (ACCELERATE_COMPAT_DIR / f"{parts[2]}.py").exists():
                    inside.add(parts[2])
            elif (PACKAGE / f"{parts[1]}.py").exists() or (PACKAGE / parts[1]).is_dir():
                outside.add(parts[1])
    return inside, outside


def test_accelerate_compat_modules_import_only_modules_below_them():
    present = {p.stem for p in ACCELERATE_COMPAT_DIR.glob("*.py")} - {"__init__"}
    assert present == set(ACCELERATE_COMPAT), "list each module of accelerate_compat/ in its layer"
    order = list(ACCELERATE_COMPAT)
    for i, name in enumerate(order):
        inside, outside = _accelerate_compat_imports(ACCELERATE_COMPAT_DIR / f"{name}.py")
        assert inside - {name} <= set(order[:i]), (name, sorted(inside - set(order[:i]) - {name}))
        assert outside <= ACCELERATE_COMPAT[name], (name, sorted(outside - ACCELERATE_COMPAT[name]))
    inside, outside = _accelerate_compat_imports(PACKAGE / "accelerator.py")
    assert not outside, ("accelerator.py re-exports accelerate_compat only", sorted(outside))
    above = {PACKAGE / "__init__.py", PACKAGE / "accelerator.py"}  # the re-exports
    for path in PACKAGE.rglob("*.py"):
        if path in above or path.parent == ACCELERATE_COMPAT_DIR:
            continue
        inside, _ = _accelerate_compat_imports(path)
        assert not inside, (f"{path.name} sits below the accelerate surface", sorted(inside))


def test_accelerate_compat_modules_stay_small():
    for path in [PACKAGE / "accelerator.py", *ACCELERATE_COMPAT_DIR.glob("*.py")]:
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= MAX_LINES, (path.name, lines)


# ---------------------------------------------------------------- the Engine and its parts
#: The Engine facade, the modules it delegates to, and the backends: each capped at MAX_LINES.
ENGINE_MODULES = [
    "engine",
    "engine_env",
    "engine_generation",
    "engine_metrics",
    "engine_saving",
    "boundary",
    "process_group",
    "guards",
    "auto_values",
    "auto_stage",
    "step_state",
    "scheduler",
    "dataloader",
    "sharding",
]


def test_the_engine_and_its_parts_stay_small():
    paths = [PACKAGE / f"{name}.py" for name in ENGINE_MODULES]
    paths += sorted((PACKAGE / "backends").glob("*.py"))
    for path in paths:
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= MAX_LINES, (path.name, lines)


def test_the_boundary_policy_and_the_process_group_stand_alone():
    # no process group, no backend, no model: the policy reads the step state only
    assert _ds_engine_imports(PACKAGE / "boundary.py") - {"boundary"} == {"step_state"}
    assert not _ds_engine_imports(PACKAGE / "process_group.py") - {"process_group"}
    assert not _ds_engine_imports(PACKAGE / "engine_env.py") - {"engine_env"}
    assert _ds_engine_imports(PACKAGE / "auto_values.py") - {"auto_values"} == set()
    # the "auto" stage decision: the estimator and the config line, nothing of the Engine or a backend
    allowed = {"memory", "config", "config_rules", "errors", "_values"}
    assert _ds_engine_imports(PACKAGE / "auto_stage.py") - {"auto_stage"} <= allowed


def test_no_module_of_the_package_grows_past_the_cap():
    """Every module of ds_engine, the command line and the accelerate surface included."""
    over = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            over[str(path.relative_to(PACKAGE))] = lines
    assert over == {}, f"split these by concern (at most {MAX_LINES} lines each): {over}"


def test_the_command_line_modules_layer():
    # the estimate command and the shared error wording sit below cli.py, never importing it
    assert "cli" not in _ds_engine_imports(PACKAGE / "cli_estimate.py")
    assert _ds_engine_imports(PACKAGE / "_cli_errors.py") - {"_cli_errors"} == set()
