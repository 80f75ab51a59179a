"""A package docstring that maps its modules names every one of them (read with ``ast``: nothing is imported,
so an engine's package is checked without the engine)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def unnamed(package: Path) -> list[str]:
    """The modules of ``package`` that its ``__init__``'s docstring does not name as ````module````."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    modules = sorted(path.stem for path in package.glob("*.py") if path.stem != "__init__")
    return [name for name in modules if f"``{name}``" not in doc]


@pytest.mark.parametrize("package", ["refcache/check", "refcache/engines/sglang"])
def test_the_map_names_every_module(package: str) -> None:
    assert unnamed(ROOT / package) == []


def test_a_module_left_out_is_named(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text('"""* ``a`` — one."""\n', encoding="utf-8")
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text("", encoding="utf-8")
    assert unnamed(tmp_path) == ["b"]
