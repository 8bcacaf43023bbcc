"""The package's layers, read from its imports: the run config is read once, scoring stands alone."""

import ast
import json
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "transformer_jax"


def _imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_the_entry_layer_config_builder_imports_ml_collections():
    importers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                       if any(m.split(".")[0] == "ml_collections" for m in _imported_modules(p)))
    assert importers == ["run_config.py"]


def _loaded_after_import(modules: list[str]) -> list[str]:
    """The transformer_jax modules a fresh interpreter has loaded after importing ``modules``."""
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('transformer_jax'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_evaluation_inspection_and_averaging_import_nothing_from_training():
    scoring_side = ["transformer_jax.evaluation.scoring", "transformer_jax.evaluation.tasks",
                    "transformer_jax.checkpoints.restore", "transformer_jax.checkpoints.averaging",
                    "transformer_jax.inspect.run_all"]
    loaded = _loaded_after_import(scoring_side)
    assert set(scoring_side) <= set(loaded)  # the check itself saw them load
    assert [m for m in loaded if m.startswith("transformer_jax.training")] == []


def test_the_training_loop_has_no_branch_on_the_task():
    source = (PACKAGE / "training" / "loop.py").read_text(encoding="utf-8")
    for task_test in ("is_parsing", "parsing.", '"ptb"', "synthetic_trees"):
        assert task_test not in source
