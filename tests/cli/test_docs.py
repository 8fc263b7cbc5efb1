"""The docs say what the code does: the README's engine-options table is the one `EngineArgs`
generates, and the README stays a short page."""

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
    """Regenerate with ``python -m nextoken.server.published`` when `server.published` changes."""
    from nextoken.server.published import guide_table

    guide = README.parent / "docs" / "guide.md"
    assert between(guide.read_text(), "published-fields") == guide_table()


def test_layout_maps_are_generated_from_the_docstrings():
    """README's and docs/design.md's layout maps: regenerate with ``python -m nextoken.docs``."""
    from nextoken.docs import MAPS, full_map, short_map

    assert between(README.read_text(), "layout") == short_map()
    design = README.parent / "docs" / "design.md"
    assert between(design.read_text(), "layout") == full_map()
    assert set(MAPS) == {README, design}
    assert "server/" in short_map() and "lora/" in short_map() and "chat_run.py" in full_map()
