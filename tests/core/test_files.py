"""`metalearn.files`: regular files only, bounded reads, strict JSON, atomic writes.

Each door is tried with the real thing it must refuse: a FIFO with no writer (a blocking
open would hang the test, so a hang fails it by timeout), a character device, a folder, a
symbolic link out of its folder, a file over its bound, JSON with a repeated key or NaN,
and a write that the operating system refuses (a file-size limit, as a full disk refuses).
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from metalearn.files import FileError, read_bytes, read_json, regular_file, write_atomically


def test_a_regular_file_is_read_whole_and_its_bound_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(b"x" * 100)
    assert read_bytes(path, limit=100) == b"x" * 100
    with pytest.raises(FileError, match=r"holds 100 bytes, more than the 99"):
        read_bytes(path, limit=99, what="image")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_bytes(tmp_path / "missing", limit=10)


def test_a_fifo_a_device_and_a_folder_are_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "f.png"
    os.mkfifo(fifo)  # no writer: a blocking open would wait for ever
    with pytest.raises(FileError, match=r"f\.png is a FIFO \(named pipe\); give a regular file"):
        read_bytes(fifo, limit=10, what="image")
    with pytest.raises(FileError, match="is a character device"):
        regular_file("/dev/null")
    with pytest.raises(FileError, match="is a folder"):
        read_bytes(tmp_path, limit=10)


def test_a_link_out_of_its_folder_is_refused_and_one_inside_is_read(tmp_path: Path) -> None:
    folder, outside = tmp_path / "package", tmp_path / "secret"
    folder.mkdir()
    outside.write_text("secret")
    (folder / "inside").write_text("data")
    (folder / "out").symlink_to(outside)
    (folder / "in").symlink_to(folder / "inside")
    with pytest.raises(FileError, match=r"is a link to .*secret, outside"):
        read_bytes(folder / "out", limit=100, within=folder)
    assert read_bytes(folder / "in", limit=100, within=folder) == b"data"
    assert read_bytes(folder / "out", limit=100) == b"secret"  # no folder given: links followed


def test_json_is_strict(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    for text, reason in (('{"a": 1, "a": 2}', "the key 'a' appears twice"),
                         ('{"a": NaN}', "NaN is not a JSON number"),
                         ('{"a": 1', "Expecting"), (b"\xff\xfe", "")):  # fmt: skip
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(FileError, match="is not valid JSON") as caught:
            read_json(path, what="package.json")
        assert reason in str(caught.value) and "\n" not in str(caught.value)
    path.write_text('{"a": [1, 2.5, "x"]}')
    assert read_json(path) == {"a": [1, 2.5, "x"]}
    path.write_text("[" * 100_000 + "]" * 100_000)  # deeper than Python's recursion limit
    with pytest.raises(FileError, match="is not valid JSON"):
        read_json(path)


def test_write_atomically_replaces_only_when_asked_and_ignores_planted_links(
    tmp_path: Path,
) -> None:
    target, victim = tmp_path / "out.csv", tmp_path / "victim"
    victim.write_text("keep")
    for name in (".out.csv.part", ".out.csv.tmp", "out.csv.tmp"):  # names a writer might use
        (tmp_path / name).symlink_to(victim)
    write_atomically(target, "a,b\n")
    assert target.read_text() == "a,b\n" and victim.read_text() == "keep"
    with pytest.raises(FileExistsError, match="exists; pass --overwrite"):
        write_atomically(target, "new", overwrite=False)
    write_atomically(target, b"new")
    assert target.read_text() == "new" and oct(target.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file() and not p.is_symlink()) == [
        "out.csv", "victim"]  # fmt: skip


def test_a_failed_write_is_one_line_and_replaces_nothing(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"old")

    def full(file) -> None:
        file.write(b"part")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(FileError, match=r"No space left on device; free space on the disk"):
        write_atomically(target, full, what="checkpoint")
    assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["checkpoint.pt"]


def test_the_operating_system_refusing_the_write_is_one_line(tmp_path: Path) -> None:
    """A real write failure (a file-size limit: the kernel refuses the write past it, as a
    full disk does), in a child process so the limit binds nothing else."""
    target = tmp_path / "big.bin"
    target.write_bytes(b"old")
    script = textwrap.dedent(f"""
        from metalearn.files import FileError, write_atomically
        try:
            write_atomically({str(target)!r}, b"x" * 1_000_000)
        except FileError as err:
            print(err)
    """)

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         preexec_fn=limit, timeout=60, check=True)  # fmt: skip
    assert out.stdout.startswith(f"could not write file {target}: File too large; free space")
    assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["big.bin"]


def test_torch_save_on_a_full_disk_is_the_disks_one_line(tmp_path: Path) -> None:
    """torch.save reports a refused write as its own RuntimeError ("unexpected pos ..."); the
    refusal behind it is what `write_atomically` raises. A real small disk, in a child."""
    from tests.helpers.small_disk import SmallDisk

    with SmallDisk(tmp_path / "disk") as disk:
        target = disk.folder / "checkpoint.pt"
        target.write_bytes(b"old")
        disk.leave(16 << 10)
        script = textwrap.dedent(f"""
            import torch
            from metalearn.files import FileError, disk_full, write_atomically
            try:
                write_atomically({str(target)!r}, lambda f: torch.save(torch.zeros(100_000), f),
                                 what="checkpoint")
            except FileError as err:
                print(disk_full(err), err)
        """)
        out = disk.run([sys.executable, "-c", script], timeout=120)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        assert out.stdout.startswith(f"True could not write checkpoint {target}: ")
        assert out.stdout.count("\n") == 1 and "(nothing was replaced)" in out.stdout
        assert target.read_bytes() == b"old" and sorted(os.listdir(disk.folder)) == [
            "checkpoint.pt"]  # fmt: skip
