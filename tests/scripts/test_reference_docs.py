"""docs/cli.md and docs/recipes.md are what scripts/reference_docs.py generates from the code now."""

from __future__ import annotations

from tests.scripts import ROOT, load_script


def _generator():
    return load_script("reference_docs")


def test_the_references_are_current():
    stale = _generator().stale()
    assert not stale, f"{[str(p.relative_to(ROOT)) for p in stale]} are stale: run scripts/reference_docs.py"


def test_the_references_name_every_command_and_recipe_key():
    from specheads.train.objective import OBJECTIVES

    gen = _generator()
    cli, recipes = gen.cli_markdown(), gen.recipes_markdown()
    for command in ("generate", "bench", "serve", "calibrate", "loadtest", "export"):
        assert f"## specheads {command}" in cli
    assert "`--max-new-tokens`" in cli and "`--method`" in cli
    for name in OBJECTIVES.names():
        assert f"## recipe: {name}" in recipes
    assert "`optim.lr`" in recipes and "`data.max_length`" in recipes


def test_field_comments_are_read_from_the_source():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Base:
        a: int = 1  # from the base
        b: int = 2  # replaced below

    @dataclass(frozen=True)
    class Child(Base):
        b: int = 3  # the child's own
        c: str = "x"

    assert _generator().field_comments(Child) == {"a": "from the base", "b": "the child's own"}


def test_the_readme_is_a_short_guide_whose_links_resolve():
    import re

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, "the README is a guide: move reference material into docs/"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the check sees the README's links"
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            assert (doc.parent / link).exists(), f"{doc.relative_to(ROOT)} links to missing {link}"
