"""UpstreamCredential at the two edges the rotation test leaves open: a Secret swapped for a file of the
same size and mtime (only the inode differs, as with a mounted Secret's atomic symlink swap) and a value
holding a line break, which would split the header it is sent in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modeldock.clock import FakeClock
from modeldock.config import UpstreamAuthConfig
from modeldock.gateway.credentials import UpstreamCredential

OLD = "sk-vllm-old-0001"
NEW = "sk-vllm-new-0002"  # same length as OLD: the size alone cannot tell them apart


def same_stamp_but_inode(old: Path, new: Path) -> None:
    """Give `new` the mtime of `old` (to the nanosecond) and check that only the inode differs."""
    st = old.stat()
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    a, b = old.stat(), new.stat()
    assert (a.st_size, a.st_mtime_ns) == (b.st_size, b.st_mtime_ns)
    assert a.st_ino != b.st_ino


def test_a_secret_volume_symlink_swap_of_same_size_and_mtime_is_reloaded(tmp_path: Path) -> None:
    # The kubelet's layout: key -> ..data/key, ..data -> ..<timestamp>; a rotation writes a new
    # timestamped dir and renames a new ..data link over the old one (one atomic step).
    first, second = tmp_path / "..2026_01_01", tmp_path / "..2026_01_02"
    first.mkdir()
    second.mkdir()
    (first / "key").write_text(OLD + "\n")
    (second / "key").write_text(NEW + "\n")
    same_stamp_but_inode(first / "key", second / "key")
    (tmp_path / "..data").symlink_to(first.name)
    key = tmp_path / "key"
    key.symlink_to("..data/key")

    clock = FakeClock()
    cred = UpstreamCredential(UpstreamAuthConfig(file=str(key)), clock)
    assert cred.value() == f"Bearer {OLD}"

    (tmp_path / "..data_tmp").symlink_to(second.name)
    (tmp_path / "..data_tmp").replace(tmp_path / "..data")
    assert key.read_text() == NEW + "\n"
    clock.advance(1.0)
    assert cred.value() == f"Bearer {NEW}"


def test_a_rename_over_the_file_of_same_size_and_mtime_is_reloaded(tmp_path: Path) -> None:
    key, fresh = tmp_path / "key", tmp_path / "key.new"
    key.write_text(OLD)
    fresh.write_text(NEW)
    same_stamp_but_inode(key, fresh)
    keep = tmp_path / "old"
    os.link(key, keep)  # the old inode stays alive, so the new file cannot reuse its number

    clock = FakeClock()
    cred = UpstreamCredential(UpstreamAuthConfig(file=str(key)), clock)
    assert cred.value() == f"Bearer {OLD}"
    fresh.replace(key)
    clock.advance(1.0)
    assert cred.value() == f"Bearer {NEW}"
    clock.advance(1.0)
    assert cred.value() == f"Bearer {NEW}"  # and a later stat of the same file keeps it


@pytest.mark.parametrize("inside", ["\n", "\r", "\r\n", "\0"])
def test_a_file_credential_with_a_line_break_inside_is_refused(tmp_path: Path, inside: str) -> None:
    key = tmp_path / "key"
    key.write_text(f"{OLD}{inside}{NEW}\n")
    cred = UpstreamCredential(UpstreamAuthConfig(file=str(key)), FakeClock())
    assert cred.value() is None
    assert cred.problem == f"file {key} holds more than one line"
    assert OLD not in cred.problem and NEW not in cred.problem


@pytest.mark.parametrize("inside", ["\n", "\r", "\0"])
def test_an_env_credential_with_a_line_break_inside_is_refused(inside: str) -> None:
    cred = UpstreamCredential(UpstreamAuthConfig(env="K"), FakeClock(), environ={"K": f"{OLD}{inside}{NEW}"})
    assert cred.value() is None
    assert cred.problem == "environment variable K holds more than one line"


def test_a_rotation_from_two_lines_to_one_is_accepted(tmp_path: Path) -> None:
    # The refusal is of the value, not sticky: fixing the file brings the credential back.
    key = tmp_path / "key"
    key.write_text(f"{OLD}\n{NEW}\n")
    clock = FakeClock()
    cred = UpstreamCredential(UpstreamAuthConfig(file=str(key)), clock)
    assert cred.value() is None
    key.write_text(f"\n  {NEW}\r\n")  # surrounding whitespace and a CRLF ending are not part of the key
    clock.advance(1.0)
    assert cred.value() == f"Bearer {NEW}"
