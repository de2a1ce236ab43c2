from __future__ import annotations

import os
from pathlib import Path

import pytest

from modeldock.filewatch import FileWatch


def test_changes_are_seen_once_and_a_missing_file_is_no_change(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("a")
    changes: list[str] = []
    polls: list[int] = []
    watch = FileWatch(path, lambda: changes.append(path.read_text()), on_poll=lambda: polls.append(1))
    assert watch.check() is False and changes == []  # the contents at start are already in use
    path.write_text("bb")
    assert watch.check() is True and changes == ["bb"]
    assert watch.check() is False and changes == ["bb"]
    path.unlink()
    assert watch.check() is False and changes == ["bb"]  # the last good contents stay
    new = tmp_path / "new.yaml"
    new.write_text("ccc")
    os.symlink(new, path)  # a mounted ConfigMap swaps a symlink
    assert watch.check() is True and changes == ["bb", "ccc"]
    assert len(polls) == 5


def test_interval_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        FileWatch(tmp_path / "x", lambda: None, interval=0)
