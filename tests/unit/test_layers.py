"""The layer order of specstack/layers.py holds: every import (top-level, in a function, under
TYPE_CHECKING) points to the importer's own layer or below, and no modules or packages import each
other in a circle. tests/layering.py is the checker; here it runs on the real tree and on a toy one."""
from __future__ import annotations

from pathlib import Path

import layering

import specstack
from specstack.layers import LAYERS, layer_of

ROOT = Path(specstack.__file__).parent


def test_specstack_imports_follow_the_layers():
    problems = layering.check(ROOT)
    assert not problems, "layering broken (file:line  importer (layer) -> imported (layer)):\n" + "\n".join(problems)


def test_checker_places_modules_as_layer_of_does():
    for name in layering.modules(ROOT):
        if name != "specstack":  # the package itself: the checker's bottom-layer rule
            assert layering.owner(name, LAYERS, "specstack")[0] == layer_of(name), name


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_checker_reports_an_upward_import_a_circle_and_a_stray_module(tmp_path):
    _write(tmp_path, {
        "toy/__init__.py": "from toy.base import f\n",
        "toy/base.py": "def f():\n    x = 1\n    from toy.high import a\n    return a, x\n",
        "toy/high/__init__.py": "",
        "toy/high/a.py": "from toy.side import b\n",
        "toy/side/__init__.py": "",
        "toy/side/b.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..high import a\n",
        "toy/stray.py": "import toy.base\n",
    })
    layers = (("low", ("toy.base",)), ("high", ("toy.high", "toy.side")))
    assert layering.check(tmp_path / "toy", layers) == [
        "toy/stray.py:1  toy.stray belongs to no layer",
        "toy/base.py:3  toy.base (low) -> toy.high.a (high)  [function]",
        "circle of modules: toy.high.a  ->  toy.side.b (toy/high/a.py:1)  ->  toy.high.a (toy/side/b.py:4)",
        "circle of packages: toy.high  ->  toy.side (toy/high/a.py:1)  ->  toy.high (toy/side/b.py:4)",
    ]


def test_checker_passes_the_toy_once_mended(tmp_path):
    _write(tmp_path, {
        "toy/__init__.py": "",
        "toy/base.py": "def f():\n    return 1\n",
        "toy/high/__init__.py": "",
        "toy/high/a.py": "from toy.side import b\nfrom toy.base import f\n",
        "toy/side/__init__.py": "",
        "toy/side/b.py": "from .. import base\n",
    })
    layers = (("low", ("toy.base",)), ("high", ("toy.high", "toy.side")))
    assert layering.check(tmp_path / "toy", layers) == []
