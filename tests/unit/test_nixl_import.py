"""Which NIXL build the runtime imports (``storage_backends.nixl_import``): the one for
torch's CUDA major, any installed one on a CPU-only torch, a forced one, and errors that
name the package to install."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch

from storage_backends import nixl_import
from storage_backends.nixl_import import NixlImportError, nixl_api, nixl_module

INSTALLED = [m for m in ("nixl_cu12", "nixl_cu13") if importlib.util.find_spec(m) is not None]


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(nixl_import.ENV, raising=False)
    nixl_module.cache_clear()
    yield
    nixl_module.cache_clear()


def test_a_build_is_installed_and_gives_the_agent_api() -> None:
    assert INSTALLED, "neither nixl-cu12 nor nixl-cu13 is installed"
    agent, config = nixl_api()
    assert agent.__module__.split(".")[0] in INSTALLED
    assert callable(agent) and callable(config)


def test_cpu_torch_takes_the_default_build_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    assert nixl_module().__name__ == INSTALLED[0]  # nixl_cu12 when both are there


@pytest.mark.parametrize("major", [12, 13])
def test_cuda_torch_takes_the_build_of_its_major_or_names_the_package(monkeypatch: pytest.MonkeyPatch, major: int) -> None:
    monkeypatch.setattr(torch.version, "cuda", f"{major}.0")
    want = f"nixl_cu{major}"
    if want in INSTALLED:
        assert nixl_module().__name__ == want
    else:
        with pytest.raises(NixlImportError, match=f"needs nixl-cu{major}.*pip install") as err:
            nixl_module()
        if INSTALLED:  # the build that is there is named, and why it does not do
            assert "cannot register" in str(err.value)


def test_cuda_major_without_a_build_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "11.8")
    with pytest.raises(NixlImportError, match="CUDA 11"):
        nixl_module()


def test_forced_build(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl_cu12", "nixl_cu13"):
        nixl_module.cache_clear()
        monkeypatch.setenv(nixl_import.ENV, name)
        if name in INSTALLED:
            assert nixl_module().__name__ == name
        else:
            with pytest.raises(NixlImportError, match=f"pip install {name.replace('_', '-')}"):
                nixl_module()
    nixl_module.cache_clear()
    monkeypatch.setenv(nixl_import.ENV, "nixl_rocm")
    with pytest.raises(NixlImportError, match="expected one of"):
        nixl_module()
