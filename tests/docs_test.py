"""The README is a short front page and the documentation's links hold.

* README.md stays under 10,000 characters (depth lives in docs/);
* every relative Markdown link in README.md and docs/*.md points to an existing
  file, and a ``file.md#anchor`` link to an existing heading of that file
  (GitHub's anchor rules);
* the README's documentation index links every docs/*.md file.

Under Bazel the test's data holds README.md and docs/*.md only (//:docs), so a
link to any other file needs that file added to the target's data.
"""

import os
import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(os.path.abspath(__file__)).parent.parent
README_LIMIT = 10_000
INDEX_HEADING = "Documentation"

_FENCE = re.compile(r"^(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target ends at whitespace or ')'
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str):
    """The lines outside fenced code blocks, with inline code removed."""
    in_fence = False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield _INLINE_CODE.sub("", line)


def github_slug(heading: str) -> str:
    """GitHub's heading anchor: markup dropped, lowercase, punctuation except '-' and '_' dropped,
    each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    """Every heading anchor of a Markdown file, repeated headings numbered as GitHub does (-1, -2, ...)."""
    seen: dict = {}
    result = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        match = None if in_fence else _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def links(path: Path) -> list:
    """The link targets of a Markdown file (inline links, images and reference definitions)."""
    found = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        found.extend(m.group(1) for m in _LINK.finditer(line))
        ref = _REFERENCE_DEF.match(line)
        if ref:
            found.append(ref.group(1))
    return found


def _is_relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("//")


def broken_links(path: Path) -> list:
    """'file: target (why)' for each relative link of ``path`` that does not resolve."""
    problems = []
    for target in links(path):
        if not _is_relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = Path(os.path.normpath(path.parent / unquote(file_part))) if file_part else path
        try:
            shown = path.relative_to(ROOT)
        except ValueError:
            shown = path
        if file_part.startswith("/"):
            problems.append(f"{shown}: {target} (absolute path; use a path relative to the file)")
        elif not dest.exists():
            problems.append(f"{shown}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            problems.append(f"{shown}: {target} (no heading with anchor #{anchor} in {dest.name})")
    return problems


def markdown_files() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _index_section(readme: str) -> str:
    match = re.search(rf"^##\s+{INDEX_HEADING}\s*$(.*?)(?=^##\s|\Z)", readme, re.M | re.S)
    assert match, f"README.md has no '## {INDEX_HEADING}' section (the index of docs/)"
    return match.group(1)


def test_readme_is_short():
    size = len((ROOT / "README.md").read_text(encoding="utf-8"))
    assert size < README_LIMIT, f"README.md has {size} characters; keep it under {README_LIMIT} (move depth to docs/)"


def test_docs_exist():
    assert list((ROOT / "docs").glob("*.md")), "docs/ holds no Markdown files"


def test_relative_links_resolve():
    problems = [p for f in markdown_files() for p in broken_links(f)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_index_lists_every_doc():
    section = _index_section((ROOT / "README.md").read_text(encoding="utf-8"))
    listed = {m.group(1).split("#")[0] for line in _prose_lines(section) for m in _LINK.finditer(line)}
    missing = [f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in listed]
    assert not missing, f"README.md's '{INDEX_HEADING}' section does not link: {', '.join(missing)}"


def test_github_slug_rules():
    assert github_slug("The `dsv4` command line") == "the-dsv4-command-line"
    assert github_slug("Packed sequences (THD) and context parallelism") == "packed-sequences-thd-and-context-parallelism"
    assert github_slug("Kernel backends, and snake_case-names!") == "kernel-backends-and-snake_case-names"
    assert github_slug("Parallel layouts on two H200s") == "parallel-layouts-on-two-h200s"


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [self](#page) [web](https://example.com/x.md)\n"
        "[missing file](nope.md) [missing anchor](other.md#no-such-section)\n"
        "`[in code](ignored.md)`\n\n```\n[in a fence](ignored.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert len(problems) == 2, problems
    assert "nope.md (no such file)" in problems[0]
    assert "other.md#no-such-section (no heading" in problems[1]



# ---------------------------------------------------------------- install paths: one Python range, exact GPU commands
def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _supported_minors() -> list:
    """The 3.x versions pyproject.toml's requires-python admits (">=3.A,<3.B" -> 3.A .. 3.B-1)."""
    spec = _pyproject()["project"]["requires-python"]
    match = re.fullmatch(r">=3\.(\d+),<3\.(\d+)", spec.replace(" ", ""))
    assert match, f"requires-python {spec!r}: expected the form '>=3.A,<3.B' (an upper bound: untested versions are not claimed)"
    return [f"3.{m}" for m in range(int(match.group(1)), int(match.group(2)))]


def _lock(name: str) -> dict:
    pins = {}
    for line in (ROOT / "third_party" / name).read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            pkg, version = line.strip().split("==")
            pins[pkg.lower()] = version
    return pins


def test_one_python_range_for_every_install_path():
    minors = _supported_minors()
    spec = _pyproject()["project"]["requires-python"]
    stated = " or ".join(minors)                                     # "3.11 or 3.12"
    assert f"Python {stated}" in (ROOT / "README.md").read_text(encoding="utf-8")
    install = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    assert f"Python {stated}:" in install and f'`requires-python = "{spec}"`' in install
    # the Bazel venv accepts exactly these versions
    bzl = (ROOT / "third_party" / "python_venv.bzl").read_text(encoding="utf-8")
    listed = re.search(r"^SUPPORTED_PYTHON = \[(.*)\]$", bzl, re.M)
    assert listed and re.findall(r'"([\d.]+)"', listed.group(1)) == minors
    assert f"({stated}, pyproject.toml)" in bzl
    # CI checks the lowest
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8") if (ROOT / ".ci" / "run").is_file() else None
    if ci is not None:                        # (not in Bazel's runfiles)
        assert "requires-python" in ci


def test_the_gpu_commands_install_the_measured_versions():
    """The README's GPU install names the lock and extras that exist, and they pin the recorded versions."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = 'pip install -c third_party/requirements-gpu.lock ".[gpu,tilelang]"'
    assert command in readme and command in (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    extras = _pyproject()["project"]["optional-dependencies"]
    gpu = _lock("requirements-gpu.lock")
    recorded = {"torch": "2.11.0", "triton": "3.6.0", "tilelang": "0.1.15", "megatron-core": "0.19.2",
                "transformers": "5.24.0"}
    for pkg, version in recorded.items():
        assert gpu[pkg] == version, (pkg, gpu.get(pkg))
    for spec in extras["gpu"] + extras["tilelang"]:       # every exact pin of the extras is the lock's
        if "==" in spec:
            pkg, version = spec.split("==")
            assert gpu[pkg.lower()] == version, spec
    assert "torch 2.11.0+cu130, Triton 3.6.0, TileLang 0.1.15" in readme
    assert gpu["cuda-toolkit"].startswith("13.0.")            # PyPI's torch 2.11.0 is the CUDA 13.0 build
    # the CPU locks and the GPU lock agree on the packages they share with dsv4's own pins
    cpu = {**_lock("requirements.lock"), **_lock("requirements-nodeps.lock")}
    assert cpu["megatron-core"] == gpu["megatron-core"] and cpu["transformers"] == gpu["transformers"]


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
