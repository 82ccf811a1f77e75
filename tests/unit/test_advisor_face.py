"""The advisor package's face (``advisor/__init__.py``): every name it exports resolves to the
object its room defines, and importing one room does not load the others (the face is lazy,
PEP 562)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import advisor


def test_every_exported_name_is_its_rooms_object() -> None:
    assert len(advisor.__all__) > 40
    for name in advisor.__all__:
        room = advisor._FACE[name]
        assert getattr(advisor, name) is getattr(importlib.import_module(room), name), name
    assert set(advisor.__all__) == set(advisor._FACE)
    assert set(advisor.__all__) <= set(dir(advisor))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        advisor.NoSuchThing  # noqa: B018
    with pytest.raises(ImportError):
        exec("from advisor import NoSuchThing")


def test_importing_the_index_room_loads_neither_the_service_nor_the_cluster() -> None:
    code = ("import sys, advisor.index, advisor.policy\n"
            "print(sorted(m for m in sys.modules if m.startswith(('advisor.embedded', 'advisor.cluster', 'advisor.ops', 'fastapi'))))\n"
            "from advisor import AdvisorService\n"
            "print('advisor.embedded' in sys.modules, AdvisorService.__module__)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    first, second = run.stdout.splitlines()
    assert first == "[]", first
    assert second.startswith("True advisor.embedded"), second
