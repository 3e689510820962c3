"""The trainer stays small enough to read (issue #33, "Done when"): ``train/`` holds at most 4,000 lines, no
function of ``train/`` is longer than 80 lines, and no class of the trainer modules (the loop, the steps, the run
folder) longer than 250. Counted with ``ast`` on the source: a function's or class's lines run from its ``def`` /
``class`` (or first decorator) to its last line, docstring and comments included."""

from __future__ import annotations

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "train"
MAX_PACKAGE_LINES = 4000
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250
TRAINER_MODULES = ("trainer.py", "sft.py", "grpo.py", "step_common.py", "run_folder.py")


def _lines(node) -> int:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - first + 1


def _too_long(path: Path, kinds, limit: int) -> list:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.name}:{n.lineno} {n.name}: {_lines(n)} lines (at most {limit})" for n in ast.walk(tree)
            if isinstance(n, kinds) and _lines(n) > limit]


def test_train_holds_at_most_4000_lines():
    counts = {p.name: len(p.read_text().splitlines()) for p in sorted(TRAIN.glob("*.py"))}
    assert sum(counts.values()) <= MAX_PACKAGE_LINES, \
        f"train/ has {sum(counts.values())} lines (at most {MAX_PACKAGE_LINES}); largest: " + \
        ", ".join(f"{n} {c}" for n, c in sorted(counts.items(), key=lambda kv: -kv[1])[:5])


def test_no_function_of_train_is_over_80_lines():
    long = [msg for p in sorted(TRAIN.glob("*.py"))
            for msg in _too_long(p, (ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)]
    assert not long, "functions to split:\n" + "\n".join(long)


def test_no_class_of_the_trainer_is_over_250_lines():
    for name in TRAINER_MODULES:
        assert (TRAIN / name).is_file(), f"train/{name} is gone: update TRAINER_MODULES"
    long = [msg for name in TRAINER_MODULES for msg in _too_long(TRAIN / name, ast.ClassDef, MAX_CLASS_LINES)]
    assert not long, "classes to split:\n" + "\n".join(long)


def test_the_counter_sees_a_long_function_and_class(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("@staticmethod\ndef f():\n" + "    x = 1\n" * 80 + "\n\nclass C:\n" + "    y = 1\n" * 10)
    assert _too_long(src, ast.FunctionDef, 80) == ["m.py:2 f: 82 lines (at most 80)"]
    assert _too_long(src, ast.ClassDef, 10) == ["m.py:85 C: 11 lines (at most 10)"]
    assert not _too_long(src, ast.ClassDef, 11)


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
