"""Volume descriptor validation: clear VolumeConfigErrors, nothing registered or recorded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage_backends import (
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    VolumeConfigError,
    VolumeDescriptor,
    VolumeKind,
    validate_descriptor,
)


def posix(root: Path | str, vid: str = "v", capacity: object = 1 << 20) -> VolumeDescriptor:
    return VolumeDescriptor(vid, VolumeKind.POSIX, MediaClass.SSD, capacity, root=str(root))  # type: ignore[arg-type]


@pytest.fixture
def agent(tmp_path: Path) -> StorageAgent:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    a = StorageAgent(cat, name=f"desc-{tmp_path.name}", allowed_roots=[tmp_path / "allowed", tmp_path / "also"])
    yield a
    a.close()
    cat.close()


def test_root_outside_the_allowed_roots_names_both(agent: StorageAgent, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "vol"
    with pytest.raises(VolumeConfigError) as ei:
        agent.register_volume(posix(outside))
    msg = str(ei.value)
    assert "outside the allowed roots" in msg and str(outside) in msg
    assert str(tmp_path / "allowed") in msg and str(tmp_path / "also") in msg
    assert agent.volumes() == [] and agent.catalog.volume_specs() == {}
    assert not outside.exists()  # refused before anything was created


def test_dotdot_and_symlink_escapes_are_refused(agent: StorageAgent, tmp_path: Path) -> None:
    (tmp_path / "allowed").mkdir()
    with pytest.raises(VolumeConfigError, match="outside the allowed roots"):
        agent.register_volume(posix(f"{tmp_path}/allowed/../elsewhere"))
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", tmp_path / "allowed" / "link")
    with pytest.raises(VolumeConfigError, match="resolved .*secret"):
        agent.register_volume(posix(tmp_path / "allowed" / "link"))
    # a sibling whose name merely starts with an allowed root's name is outside too
    with pytest.raises(VolumeConfigError, match="outside"):
        agent.register_volume(posix(tmp_path / "allowed-not"))
    assert agent.volumes() == []


def test_roots_inside_are_accepted(agent: StorageAgent, tmp_path: Path) -> None:
    agent.register_volume(posix(tmp_path / "allowed" / "a" / "b", vid="deep"))
    agent.register_volume(posix(tmp_path / "also", vid="exact"))
    assert [v.id for v in agent.volumes()] == ["deep", "exact"]
    # no allowed_roots: anywhere goes (the default)
    validate_descriptor(posix(tmp_path / "anywhere"))


@pytest.mark.parametrize("capacity", [0, -1, 1.5, "10GiB", True, None])
def test_capacity_must_be_a_positive_int(agent: StorageAgent, tmp_path: Path, capacity: object) -> None:
    with pytest.raises(VolumeConfigError, match=r"capacity_bytes must be a positive size .* got " + repr(capacity).replace(".", r"\.")):
        agent.register_volume(posix(tmp_path / "allowed", capacity=capacity))


def test_unknown_kind_and_missing_bucket(agent: StorageAgent, tmp_path: Path) -> None:
    with pytest.raises(VolumeConfigError, match=r"volume 'x': unknown kind 'nfs' \(expected one of \['posix', 's3'\]\)"):
        agent.register_volume(VolumeDescriptor("x", "nfs", MediaClass.SSD, 100, root=str(tmp_path / "allowed")))  # type: ignore[arg-type]
    with pytest.raises(VolumeConfigError, match=r"s3 volume 'x' needs a bucket"):
        agent.register_volume(VolumeDescriptor("x", VolumeKind.S3, MediaClass.OBJECT, 100, endpoint="http://127.0.0.1:1"))
    with pytest.raises(VolumeConfigError, match=r"needs a root directory"):
        agent.register_volume(VolumeDescriptor("x", VolumeKind.POSIX, MediaClass.SSD, 100))
    assert agent.volumes() == []
