"""Each hostile ``.pt2`` of `tests.helpers.hostile_programs` is live: torch alone (no
metalearn code) runs what it carries, and the test sees the file it leaves.

The guard, the placeholder, the file overwrite and the hidden pickle run inside this process
(nothing there can hang). The AOTInductor doors (a library's constructor, a member that
leaves the extraction folder) run in a child process with its own temporary folder, since
torch's C++ loader leaves its extraction behind when loading fails; the forged numpy dtype
runs in a child too, since it crashes its process. Every child has a timeout. The zip bomb
and the sympy tower are built and read, never loaded.
"""

from __future__ import annotations

import ast
import json
import os
import pickletools
import resource
import signal
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from tests.helpers.hostile_programs import (
    BOMB_CHUNK,
    ESCAPED,
    FILL_BYTE,
    METADATA,
    TOWER,
    WILD_POINTER,
    build_file_overwrite,
    build_guard_program,
    build_hidden_escape,
    build_hidden_library,
    build_hidden_pickle,
    build_placeholder_default,
    build_tower_expression,
    build_zip_bomb,
    compiler,
    escape_name,
    forged_dtype_pickle,
    genuine_members,
)

CHILD_TIMEOUT = 300  # seconds: a hang guard for a child that imports torch on a loaded machine

_DOORS = {
    "export_load": "torch.export.load",
    "aoti_load_package": "torch._inductor.aoti_load_package",
}


def _no_core_dump() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _child(
    code: str, *args: str, cwd: Path, tmpdir: Path | None = None, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    """``python -c code args`` in ``cwd`` (``TMPDIR`` set to ``tmpdir`` if given), within
    `CHILD_TIMEOUT`."""
    env = dict(os.environ, **({"TMPDIR": str(tmpdir)} if tmpdir else {}))
    return subprocess.run(
        [sys.executable, "-c", code, *args], input=stdin, capture_output=True, cwd=cwd,
        env=env, timeout=CHILD_TIMEOUT, preexec_fn=_no_core_dump,
    )  # fmt: skip


def _reference(x: torch.Tensor) -> torch.Tensor:
    """The genuine program's output, from the module it was exported from (seeded 0)."""
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)(x)


def _model(path: Path, root: str) -> dict:
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read(f"{root}/models/model.json"))


def test_a_guard_of_constants_runs_os_system_on_every_call(tmp_path):
    marker = tmp_path / "marker"
    path = build_guard_program(tmp_path, marker)
    (guard,) = _model(path, "guard")["guards_code"]
    tree = ast.parse(guard, mode="eval").body
    assert isinstance(tree, ast.Compare)  # made of constants only: 1 == '<a string>'
    assert all(isinstance(n, ast.Constant) for n in [tree.left, *tree.comparators])
    module = torch.export.load(path).module()
    assert not marker.exists()  # neither loading nor building the module ran it
    for _ in range(2):
        # os.system's status, 0, spliced into the message: the call ran, then the guard failed
        with pytest.raises(AssertionError, match=r"^Guard failed: 1 == '0'$"):
            module(torch.randn(5, 4))
        assert marker.exists()
        marker.unlink()


def test_a_placeholder_name_runs_its_default_argument_while_loading(tmp_path):
    marker = tmp_path / "marker"
    path = build_placeholder_default(tmp_path, marker)
    program = torch.export.load(path)  # builds the graph module: the def ran
    assert marker.exists()
    user_input = [n.target for n in program.graph.nodes if n.op == "placeholder"][-1]
    assert user_input.startswith("x, _y=__import__('os').system('touch ")


def test_a_graph_of_torch_operators_overwrites_a_file(tmp_path):
    victim = tmp_path / "victim"
    original = b"a victim file, 32 bytes long...\n"
    victim.write_bytes(original)
    path = build_file_overwrite(tmp_path, victim, size=16)
    program = torch.export.load(path)
    calls = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert [str(t) for t in calls] == ["aten.from_file.default", "aten.fill_.Scalar",
                                       "aten.linear.default"]  # fmt: skip
    module = program.module()
    assert victim.read_bytes() == original  # neither loading nor building the module ran it
    x = torch.randn(5, 4)
    torch.testing.assert_close(module(x), _reference(x), atol=0, rtol=0)
    assert victim.read_bytes() == bytes([FILL_BYTE]) * 16 + original[16:]


def _python_sees_the_genuine_program(path: Path, tmp_path: Path) -> None:
    """Python's ``zipfile`` lists exactly the members of a genuine program saved under the
    same name, and each reads back with a valid CRC."""
    (tmp_path / "genuine").mkdir()
    genuine = genuine_members(tmp_path / "genuine" / path.name)
    with zipfile.ZipFile(path) as archive:
        assert archive.namelist() == [m.name for m in genuine]
        assert archive.testzip() is None


def _torch_records(path: Path) -> list[str]:
    """The members torch's own reader lists (its names below the archive's root)."""
    return torch._C.PyTorchFileReader(str(path)).get_all_records()


def test_a_hidden_pickled_constant_runs_while_loading(tmp_path):
    marker = tmp_path / "marker"
    path = build_hidden_pickle(tmp_path, marker)
    _python_sees_the_genuine_program(path, tmp_path)
    with zipfile.ZipFile(path) as archive:
        config = archive.read("pickle/data/constants/model_constants_config.json")
    assert json.loads(config) == {"config": {}}
    assert "data/constants/opaque_obj_0" in _torch_records(path)
    torch.export.load(path)
    assert marker.exists()


_LOAD = """
import sys, torch, torch._inductor
door = {door}
try:
    door(sys.argv[1])
except Exception as error:  # what failed after the payload ran
    print(type(error).__name__, str(error).splitlines()[0])
"""


def _load_in_child(door: str, path: Path, tmp_path: Path) -> Path:
    """Loads ``path`` through ``door`` in a child whose temporary folder is returned."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    result = _child(_LOAD.format(door=_DOORS[door]), str(path), cwd=tmp_path, tmpdir=tmpdir)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    return tmpdir


@pytest.mark.skipif(compiler() is None, reason="no C compiler (gcc or cc) to build the library")
@pytest.mark.parametrize("door", sorted(_DOORS))
def test_a_hidden_aotinductor_library_runs_its_constructor(tmp_path, door):
    marker = tmp_path / "marker"
    folder = tmp_path / "in"
    folder.mkdir()
    path = build_hidden_library(folder, marker)
    _python_sees_the_genuine_program(path, tmp_path)
    assert "data/aotinductor/model/wrapper.so" in _torch_records(path)
    assert not marker.exists()
    _load_in_child(door, path, tmp_path)
    assert marker.read_text() == "ran"


@pytest.mark.parametrize("door", sorted(_DOORS))
def test_a_hidden_member_is_extracted_outside_the_folder(tmp_path, door):
    outside = tmp_path / "outside"
    outside.mkdir()
    marker = outside / "escaped"
    folder = tmp_path / "in"
    folder.mkdir()
    path = build_hidden_escape(folder, marker)
    _python_sees_the_genuine_program(path, tmp_path)
    assert escape_name(marker) in _torch_records(path)
    tmpdir = _load_in_child(door, path, tmp_path)
    assert marker.read_bytes() == ESCAPED
    # The C++ loader's folders, left behind: the model's lies in one; the member in none.
    extractions = list(tmpdir.glob("aotinductor_*"))
    assert any((e / "escape/data/aotinductor/model").is_dir() for e in extractions)
    assert not any(p.name == "escaped" for e in extractions for p in e.rglob("*"))
    assert sorted(p.name for p in folder.iterdir()) == ["escape.pt2"]


def test_a_small_zip_bomb_declares_gigabytes(tmp_path):
    path = build_zip_bomb(tmp_path, tmp_path / "unused")
    size = path.stat().st_size
    assert 1_500_000 < size < 1_700_000
    (tmp_path / "genuine").mkdir()
    genuine = genuine_members(tmp_path / "genuine" / path.name)
    with zipfile.ZipFile(path) as archive:  # no testzip(): it would inflate the bomb
        assert archive.namelist() == [m.name for m in genuine]
        info = archive.getinfo("bomb/extra/metalearn.json")
    assert info.compress_type == zipfile.ZIP_DEFLATED
    assert info.file_size > 1000 * size and info.file_size % BOMB_CHUNK == 0
    # The stream is real: its first 64 KiB inflate (bounded to 256 MiB) over a thousandfold.
    with path.open("rb") as f:
        f.seek(info.header_offset)
        name_length, extra_length = struct.unpack("<HH", f.read(30)[26:30])
        f.seek(info.header_offset + 30 + name_length + extra_length)
        head = f.read(64 * 1024)
    inflated = zlib.decompressobj(-15).decompress(head, 256 << 20)
    assert len(inflated) > 1000 * len(head) and inflated == b" " * len(inflated)


def test_a_sympy_tower_is_every_shape_expression(tmp_path):
    path = build_tower_expression(tmp_path, tmp_path / "unused")  # never loaded
    with zipfile.ZipFile(path) as archive:
        text = archive.read("tower/models/model.json").decode()
        assert json.loads(archive.read("tower/extra/metalearn.json")) == METADATA
    assert text.count('"expr_str": ') == text.count(f'"expr_str": "{TOWER}"') == 2
    assert "Symbol(" not in text


_UNPICKLE = """
import pickle, sys
import numpy as np
array = pickle.loads(sys.stdin.buffer.read())
genuine = np.dtype([("f", "O")])
print("loaded", array.shape, array.dtype == genuine, array.dtype.hasobject, genuine.hasobject,
      array.tobytes().hex(), flush=True)
print("field", repr(array["f"][0]), flush=True)
"""


def test_a_forged_dtype_pickle_reads_a_wild_pointer(tmp_path):
    data = forged_dtype_pickle()
    globals_named = {arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
    assert globals_named == {"numpy dtype", "numpy.core.multiarray _reconstruct", "numpy ndarray"}
    result = _child(_UNPICKLE, cwd=tmp_path, stdin=data)
    lines = result.stdout.decode().splitlines()
    # The dtype equals the genuine object dtype, yet says it holds no object, so numpy took
    # the raw bytes; reading the field then dereferences them and the process dies.
    assert lines == [f"loaded (1,) True False True {WILD_POINTER:016x}"], result
    assert -result.returncode in (signal.SIGSEGV, signal.SIGBUS), result  # killed by a signal
