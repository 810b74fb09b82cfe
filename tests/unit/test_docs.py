"""The README and docs/ are a user's documents: what they show runs, what they link exists.

* The README's quick-start script is, line for line, `scripts/examples/quickstart.py`, which
  `tests/distributed/test_examples.py` launches on 2 ranks.
* The README keeps exactly two set-up commands.
* Every relative link in the README and docs/ names a file that exists.
* Neither speaks of the project's own development (issue numbers, work sessions).
* Every python block in docs/ is an excerpt that names the complete file it comes from.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
QUICKSTART = ROOT / "scripts" / "examples" / "quickstart.py"


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def _without_docstring(source: str) -> str:
    module = ast.parse(source)
    first = module.body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant), "no module docstring"
    return "\n".join(source.splitlines()[first.end_lineno :]).strip() + "\n"


def test_readme_quick_start_is_the_example_file() -> None:
    python_blocks = _blocks(README.read_text(encoding="utf-8"), "python")
    assert python_blocks, "the README has no python block"
    assert python_blocks[0].strip() + "\n" == _without_docstring(QUICKSTART.read_text(encoding="utf-8")), (
        "the README's quick start differs from scripts/examples/quickstart.py: copy one into the other"
    )


def test_readme_keeps_exactly_two_set_up_commands() -> None:
    commands = [
        line.split("#")[0].strip()
        for block in _blocks(README.read_text(encoding="utf-8"), "bash")
        for line in block.splitlines()
        if line.startswith("bash scripts/")
    ]
    assert commands == ["bash scripts/main.sh", "bash scripts/test.sh"], commands
    for command in commands:
        assert (ROOT / command.split()[1]).is_file(), command


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.name} links to missing files: {missing}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_docs_speak_of_the_project_not_its_history(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    found = re.findall(r"\b(?:[Ii]ssues? \d+|[Tt]his session|DESIGN\.md)", text)
    assert not found, f"{page.name} refers to the project's development: {found}"


def test_code_speaks_of_the_project_not_its_history() -> None:
    pattern = re.compile(r"\b(?:[Ii]ssues? \d+|[Ss]emantic \d|[Tt]his session|DESIGN\.md)")
    found = []
    for folder in ("ds_engine", "tests", "scripts", "configs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in {".py", ".sh", ".md", ".json", ".toml"} and path.name != "test_docs.py":
                text = path.read_text(encoding="utf-8", errors="replace")
                found += [f"{path.relative_to(ROOT)}: {m}" for m in pattern.findall(text)]
    assert not found, found


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_docs_snippet_names_the_complete_file_it_comes_from(page: Path) -> None:
    """A python block in docs/ is an excerpt; its first line names the complete, tested file."""
    for block in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
        first = block.strip().splitlines()[0]
        named = re.search(r"#\s*excerpt\b.*?((?:scripts|tests)/\S+\.py)", first)
        assert named, f"{page.name}: a python block does not start with '# excerpt of <file>': {first!r}"
        assert (ROOT / named.group(1)).is_file(), f"{page.name} names a missing file: {named.group(1)}"
        source = {line.strip() for line in (ROOT / named.group(1)).read_text(encoding="utf-8").splitlines()}
        drifted = [
            line.strip()
            for line in block.strip().splitlines()[1:]
            if line.strip() and line.strip() != "..." and line.strip() not in source
        ]
        assert drifted == [], (
            f"{page.name}: lines of the excerpt of {named.group(1)} not in that file: {drifted}"
        )


def test_the_package_map_names_every_module() -> None:
    map_text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    package = ROOT / "ds_engine"
    unnamed = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        relative = path.relative_to(package).as_posix()
        folder = relative.split("/")[0] + "/" if "/" in relative else None
        if (
            f"`{relative}`" not in map_text
            and f"`{path.name}`" not in map_text
            and (folder is None or f"`{folder}`" not in map_text)
        ):
            unnamed.append(relative)
    assert unnamed == [], f"docs/design.md's package map does not name: {unnamed}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_no_placeholder_is_left_where_a_figure_belongs(page: Path) -> None:
    placeholders = [
        line for line in page.read_text(encoding="utf-8").splitlines() if re.fullmatch(r"[A-Z_]{6,}", line)
    ]
    assert placeholders == [], f"{page.name}: placeholders instead of figures: {placeholders}"
