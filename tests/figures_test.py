"""Every measured figure in README.md and docs/ comes from a committed record in bench/results/.

The convention (docs/testing.md, "Published figures"): a measured figure -- a number with a unit of
measurement: ``%``, a speed-up ``x``, ``s``, ``ms``, ``TFLOPS``, ``GB/s``, ``GiB``, ``GB``, ``MB``,
``tokens/s`` -- stands in a block (a paragraph, a list item, a table row, or a table with the paragraph
right above it) that names its record, ``bench/results/NAME.json`` (a link or inline code), and the record
holds the figure: some value of it, as written (rounded or cut to the written digits; a percentage as a
fraction or a percentage; milliseconds as seconds; TFLOPS / GB/s / GiB from their base units), or for a
speed-up the ratio of two values under the same key. A goal or bound is no measurement: written
``goal 35%`` / ``bound 1e-2`` it is skipped.

Blocks that broke the rule when it was introduced are listed in ``tests/figures_uncited.txt`` (one line per
figure: file, figure, the block's first words). The test fails on any figure that breaks the rule and is not
listed there, and on a listed line that no longer breaks it (the list only shrinks). ``python -m
tests.figures_test --write-uncited`` rewrites the list: review its diff; a new entry means a figure without a
record was added.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

ROOT = Path(os.path.abspath(__file__)).parent.parent
UNCITED = ROOT / "tests" / "figures_uncited.txt"
RECORD = re.compile(r"bench/results/[\w.{},/-]+?\.json")
BARE_RECORD = re.compile(r"(?<![\w/.-])[\w.-]+\.json")
FIGURE = re.compile(r"(?<![\w.,\-/^])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)\s?"
                    r"(%|x(?![\w-])|×|ms(?![\w])|s(?![\w/])|TFLOP/s|TFLOPS|GB/s|GiB(?![\w])|GB(?![\w/])|MB(?![\w/])"
                    r"|tokens/s|tok/s)")
NOT_MEASURED = re.compile(r"(goal|bound|at most|at least|under|<=?|>=?|limit|timeout|budget)\s*(of\s*)?$", re.I)
GOAL_AFTER = re.compile(r"[\w-]*\s*(MFU\s+)?goal\b", re.I)
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# a unit-to-record scale: the record's value x scale is the written figure
_SCALES = {"%": (100.0, 1.0), "ms": (1e3, 1.0), "s": (1.0, 1e-3), "TFLOP/s": (1e-12, 1.0), "TFLOPS": (1e-12, 1.0),
           "GB/s": (1e-9, 1.0), "GiB": (1.0 / 2**30, 1.0), "GB": (1e-9, 1.0, 1.0 / 2**30), "MB": (1e-6, 1.0, 1e3),
           "tokens/s": (1.0,), "tok/s": (1.0,)}


def markdown_files() -> List[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(text: str) -> Iterator[Tuple[str, str]]:
    """``(text, context)`` per paragraph, list item and table row, outside fenced code: a table row's figures
    may cite their record in the row or in the table's caption (the paragraph right above it); a paragraph's
    context is itself. Generated tables between ``<!-- ...:begin`` / ``:end -->`` markers are skipped."""
    para: List[str] = []
    caption = ""
    in_fence = in_generated = False
    for line in text.splitlines():
        s = line.strip()
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if re.match(r"<!--.*:begin", s):
            in_generated = True
        if in_generated:
            in_generated = not re.match(r"<!--.*:end", s)
            continue
        is_item = re.match(r"^\s*([*-]|\d+\.)\s", line)
        if not s or s.startswith("#") or s.startswith("|") or is_item:
            if para:
                caption = " ".join(para)
                yield caption, caption
                para = []
            if s.startswith("|"):
                yield s, caption + "\n" + s
                continue
            if s.startswith("#"):
                caption = ""
            if is_item:
                para = [s]
                continue
            if not s and not para:
                continue
            continue
        para.append(s)
    if para:
        yield " ".join(para), " ".join(para)


def _values(x, key: str = "") -> Iterator[Tuple[str, float]]:
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _values(v, k)
    elif isinstance(x, list):
        for v in x:
            yield from _values(v, key)
    elif isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        yield key, float(x)
    elif isinstance(x, str):
        for m in re.finditer(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", x):
            yield key, float(m.group())


def _record_paths(ref: str) -> List[Path]:
    """``bench/results/rollout-{cpu,h200}.json`` names two records."""
    m = re.search(r"\{([^}]*)\}", ref)
    if not m:
        return [ROOT / ref]
    return [ROOT / (ref[:m.start()] + part + ref[m.end():]) for part in m.group(1).split(",")]


_CACHE: Dict[Path, List[Tuple[str, float]]] = {}


def record_values(path: Path) -> List[Tuple[str, float]]:
    if path not in _CACHE:
        _CACHE[path] = list(_values(json.loads(path.read_text(encoding="utf-8"))))
    return _CACHE[path]


def _matches(value: float, written: str) -> bool:
    """``value`` written with ``written``'s digits: rounded, or cut. A record's text can hold what reads as a
    number out of range (a commit hash such as ``ac5e874``: 5e874); it matches nothing."""
    if not math.isfinite(value):
        return False
    digits = len(written.split(".")[1]) if "." in written else 0
    target = float(written)
    if round(value, digits) == target:
        return True
    cut = math.floor(abs(value) * 10 ** digits) / 10 ** digits
    return cut == abs(target) and value >= 0


def figure_in(records: List[Path], number: str, unit: str) -> bool:
    values = [kv for p in records for kv in record_values(p)]
    scales = _SCALES.get(unit, (1.0,))
    if unit in ("x", "×"):
        by_key: Dict[str, List[float]] = {}
        for k, v in values:
            by_key.setdefault(k, []).append(v)
        if any(_matches(v, number) for _, v in values):
            return True
        return any(b and _matches(a / b, number) for vs in by_key.values() for a in vs for b in vs if a != b)
    return any(_matches(v * s, number) for _, v in values for s in scales)


def problems() -> List[str]:
    """'FILE: FIGURE (why) in «first words»' for every figure that breaks the rule."""
    out = []
    for path in markdown_files():
        rel = path.relative_to(ROOT).as_posix()
        for block, context in blocks(path.read_text(encoding="utf-8")):
            refs = sorted(set(RECORD.findall(context)) | {f"bench/results/{n}" for n in BARE_RECORD.findall(context)
                                                           if (ROOT / "bench" / "results" / n).is_file()})
            prose = _CODE.sub("", block)
            where = " ".join(re.sub(r"[^\w%. -]", " ", prose).split()[:6])
            figures = [m for m in FIGURE.finditer(prose) if not NOT_MEASURED.search(prose[max(0, m.start() - 16):m.start()])
                       and not GOAL_AFTER.match(prose[m.end():m.end() + 16])]
            if not figures:
                continue
            records = [p for r in refs for p in _record_paths(r)]
            missing = [p for p in records if not p.exists()]
            for p in missing:
                out.append(f"{rel}: {p.relative_to(ROOT).as_posix()} (no such record) in «{where}»")
            records = [p for p in records if p.exists()]
            for m in figures:
                shown = f"{m.group(1)}{'' if m.group(2) in ('%', 'x') else ' '}{m.group(2)}"
                if not records:
                    out.append(f"{rel}: {shown} (no record named) in «{where}»")
                elif not figure_in(records, m.group(1).replace(",", ""), m.group(2)):
                    out.append(f"{rel}: {shown} (not in {', '.join(p.name for p in records)}) in «{where}»")
    return out


def _listed() -> List[str]:
    if not UNCITED.exists():
        return []
    return [line for line in UNCITED.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]


HEADER = ("# Figures in README.md and docs/ without a record in bench/results/ when tests/figures_test.py was introduced\n"
          "# (see its docstring). This list only shrinks: cite the record next to the figure, or say it is no\n"
          "# measurement (goal, bound), then regenerate with `python -m tests.figures_test --write-uncited`.\n")


def test_every_measured_figure_names_a_record_that_holds_it():
    found, listed = problems(), _listed()
    new = sorted(set(found) - set(listed))
    assert not new, ("figures without a record that holds them (cite bench/results/NAME.json in the same "
                     "paragraph, list item or table; docs/testing.md#published-figures):\n" + "\n".join(new))


def test_the_list_of_uncited_figures_only_shrinks():
    stale = sorted(set(_listed()) - set(problems()))
    assert not stale, ("tests/figures_uncited.txt lists figures that are now cited or gone; regenerate it: "
                       "python -m tests.figures_test --write-uncited\n" + "\n".join(stale))


def test_the_rule_rejects_a_figure_without_a_record_and_one_its_record_lacks(tmp_path, monkeypatch):
    records = tmp_path / "bench" / "results"
    records.mkdir(parents=True)
    (records / "step.json").write_text(json.dumps({"rows": [{"step_ms": 229.13, "mfu": 0.1614, "tokens_per_s": 9887.2},
                                                            {"tokens_per_s": 4943.6}]}))
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# R\n\nThe step takes 229 ms at 16.1% MFU and 9,887 tokens/s, 2.0x the other "
        "(`bench/results/step.json`; goal 35%).\n\n"
        "A step of 230 ms (`bench/results/step.json`), the 85%-of-HBM goal (step.json).\n\n"
        "Uncited: 12.5% of the time.\n\n"
        "| a | b |\n| --- | --- |\n| 17% | x |\n", encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    _CACHE.clear()
    try:
        got = problems()
    finally:
        _CACHE.clear()
    assert [g.split(" in «")[0] for g in got] == ["README.md: 230 ms (not in step.json)",
                                                  "README.md: 12.5% (no record named)",
                                                  "README.md: 17% (no record named)"]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-uncited"]:
        UNCITED.write_text(HEADER + "".join(f"{p}\n" for p in sorted(set(problems()))), encoding="utf-8")
        print(f"wrote {UNCITED}")
    else:
        from tests.runner import main as run_tests

        run_tests(__file__)
