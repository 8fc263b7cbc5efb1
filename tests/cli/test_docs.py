"""The docs say what the code does: the README's engine-options table is the one `EngineArgs`
generates, the README stays a short page, and every docstring's names of code exist."""

from __future__ import annotations

from pathlib import Path

from nextoken.engine_args import options_table

README = Path(__file__).resolve().parents[2] / "README.md"


def between(text: str, name: str) -> str:
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    assert start in text and end in text, f"the document lost its {name} markers"
    return text[text.index(start) + len(start) : text.index(end)]


def test_readme_engine_options_are_generated_from_engine_args():
    """Regenerate with ``python -m nextoken.engine_args`` when a field changes."""
    assert between(README.read_text(), "engine-options") == options_table()


def test_every_engine_flag_is_in_the_table():
    from nextoken.engine_args import EngineArgs

    table = options_table()
    for f in EngineArgs.cli_fields():
        assert f"`{f.name}`" in table and EngineArgs.flag(f) in table


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


def test_guide_lists_the_published_fields_that_change_nothing():
    """Regenerate with ``python -m nextoken.server.api.published`` when `server.api.published` changes."""
    from nextoken.server.app.openapi import guide_table

    guide = README.parent / "docs" / "guide.md"
    assert between(guide.read_text(), "published-fields") == guide_table()


def test_layout_maps_are_generated_from_the_docstrings():
    """README's and docs/design.md's layout maps: regenerate with ``python -m nextoken.docs``."""
    from nextoken.docs import MAPS, full_map, short_map

    assert between(README.read_text(), "layout") == short_map()
    design = README.parent / "docs" / "design.md"
    assert between(design.read_text(), "layout") == full_map()
    assert set(MAPS) == {README, design}
    assert "server/" in short_map() and "lora/" in short_map() and "run.py" in full_map() and "chat/" in full_map()


def test_docstrings_name_code_that_exists():
    """A dotted name in backticks in a docstring (module, class or function) that starts with one of nextoken's
    modules (`server.app.build_app`, `runner.follower`, ...) names a module, class, function or
    attribute that exists: a moved or renamed one fails here, not in a reader's hands. File
    names (``config.json``), GGUF metadata keys (``tokenizer.ggml.model``) and double-backticked
    literals are not references."""
    import ast
    import importlib
    import pkgutil
    import re

    import nextoken

    root = Path(nextoken.__file__).parent
    top = {m.name for m in pkgutil.iter_modules([str(root)])}
    dotted = re.compile(r"(?<!`)`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`(?!`)")  # ``literal text`` is no reference
    not_code = re.compile(r"\.(json|model|pre|gguf|safetensors|jinja|md|txt)$|^tokenizer\.ggml\.")
    missing = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        doc = "\n".join(ast.get_docstring(n) or "" for n in ast.walk(tree)
                        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
        for name in dotted.findall(doc):
            parts = name.removeprefix("nextoken.").split(".")
            if parts[0] not in top or not_code.search(name):
                continue
            for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
                try:
                    obj = importlib.import_module("nextoken." + ".".join(parts[:i]))
                except ImportError:
                    continue
                for attr in parts[i:]:
                    obj = getattr(obj, attr, None)
                if obj is None:
                    missing.append(f"{path.relative_to(root)}: {name}")
                break
            else:
                missing.append(f"{path.relative_to(root)}: {name}")
    assert not missing, missing
