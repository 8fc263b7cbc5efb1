"""The layout maps of the docs, generated from the modules' own docstrings, so they cannot drift:
the README's (each top-level part of the package, one line) and ``docs/design.md``'s (every
package and module). Each sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` markers.

    python -m nextoken.docs            # rewrite both maps
    python -m nextoken.docs --check    # exit 1 when a map differs from the code (tests/cli/test_docs.py)
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE.parent
WIDTH = 100
SKIP = {"__init__.py", "__main__.py", "docs.py"}
SKIP_DIRS = {"static", "__pycache__"}


SENTENCE_END = re.compile(r"(?<!\bal)(?<!e\.g)(?<!i\.e)(?<!vs)\.(\s+(?=[A-Z`(*])|$)")


def summary(path: Path) -> str:
    """The first sentence of the docstring of a module (or of a package's ``__init__.py``)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    end = SENTENCE_END.search(text)
    return text[: end.start() + 1] if end else text


def _parts(folder: Path) -> list[Path]:
    """A package's modules, then its subpackages, by name."""
    modules = sorted(p for p in folder.glob("*.py") if p.name not in SKIP)
    packages = sorted(p for p in folder.iterdir() if p.is_dir() and p.name not in SKIP_DIRS
                      and (p / "__init__.py").exists())
    return modules + packages


def _entry(name: str, text: str, indent: int, column: int) -> list[str]:
    head = " " * indent + name
    lines = textwrap.wrap(text, WIDTH - column, break_on_hyphens=False) or [""]
    first = head.ljust(column - 1) + " " + lines[0] if len(head) < column - 1 else head
    rest = lines[1:] if len(head) < column - 1 else lines
    return [first.rstrip()] + [" " * column + line for line in rest]


def _doc_of(part: Path) -> str:
    return summary(part / "__init__.py" if part.is_dir() else part)


def short_map() -> str:
    """The README's map: each package of ``nextoken/``, one sentence each, then the top-level
    modules by name (docs/design.md has the whole map)."""
    parts = _parts(PACKAGE)
    lines = ["```", "nextoken/"]
    for part in (p for p in parts if p.is_dir()):
        lines += _entry(part.name + "/", _doc_of(part), 2, 18)
    names = ", ".join(p.stem for p in parts if not p.is_dir())
    lines += _entry("*.py", names, 2, 18)
    return "\n".join(lines + ["```"]) + "\n"


def full_map() -> str:
    """docs/design.md's map: every top-level module and package with its first sentence, and
    each package's modules by name (each module's own docstring says the rest)."""
    lines = ["```", "nextoken/"]

    def walk(folder: Path, indent: int) -> None:
        parts = _parts(folder)
        if folder != PACKAGE:
            names = ", ".join(p.name for p in parts if not p.is_dir())
            if names:
                lines.extend(_entry("", names, indent, 32))
        for part in parts:
            if folder == PACKAGE or part.is_dir():
                lines.extend(_entry(part.name + ("/" if part.is_dir() else ""), _doc_of(part), indent, 32))
            if part.is_dir():
                walk(part, indent + 2)

    walk(PACKAGE, 2)
    return "\n".join(lines + ["```"]) + "\n"


MAPS = {ROOT / "README.md": ("layout", short_map), ROOT / "docs" / "design.md": ("layout", full_map)}


def _replace(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise ValueError(f"the document lost its {name} markers")
    return text[: text.index(start) + len(start)] + body + text[text.index(end):]


def main(argv: list[str]) -> int:
    stale = []
    for path, (name, make) in MAPS.items():
        text = path.read_text()
        new = _replace(text, name, make())
        if new != text:
            stale.append(path.relative_to(ROOT))
            if "--check" not in argv:
                path.write_text(new)
    if stale and "--check" in argv:
        print(f"stale layout map in {', '.join(map(str, stale))}: run python -m nextoken.docs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
