"""A ``.pt2`` from anyone runs no code through `load_exported` (and so `predict(path)`).

Each hostile file is a real exported program with one thing changed, whose loading by
``torch.export.load`` alone would create a marker file (each ``*_is_live`` test shows that
it does); `load_exported` must refuse it in one line naming the member, before torch reads
it, and the marker must not exist: a pickled opaque constant, an AOTInductor library (a
shared object whose constructor writes the marker), a member whose name leaves the
archive, a shape expression that ``sympy.sympify`` would evaluate, a guard that the
program's module runs on each call, and a node target that resolves to ``os.system``.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from metalearn.deploy import compile_aot, export_adapted, load_exported, predict
from metalearn.deploy.archive import UntrustedPackageError
from tests.helpers.pickle_writers import payload_object

ROOT = "archive/"
CONSTANTS = ROOT + "data/constants/model_constants_config.json"
MODEL = ROOT + "models/model.json"
_CONSTRUCTOR = r"""
#include <stdio.h>
__attribute__((constructor)) static void hit(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def _exported(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    return export_adapted(torch.nn.Linear(4, 3), torch.randn(2, 4), tmp_path / "a.pt2")


def _rewrite(
    source: Path, out: Path, change: Callable[[str, bytes], bytes], extra: dict[str, bytes]
) -> Path:
    """A copy of the archive ``source`` with each member's bytes passed through ``change``
    and the members ``extra`` added."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, change(name, src.read(name)))
        for name, data in extra.items():
            dst.writestr(name, data)
    return out


def _edit_json(name: str, edit: Callable[[dict], None]) -> Callable[[str, bytes], bytes]:
    def change(member: str, data: bytes) -> bytes:
        if member != name:
            return data
        tree = json.loads(data)
        edit(tree)
        return json.dumps(tree).encode()

    return change


def _opaque_constant(tmp_path: Path, marker: Path) -> Path:
    def add(config: dict) -> None:
        config["config"]["opaque_obj_0"] = {
            "path_name": "opaque_obj_0", "is_param": False, "use_pickle": True,
            "tensor_meta": None,
        }  # fmt: skip

    payload = pickle.dumps(payload_object(str(marker)))
    return _rewrite(_exported(tmp_path), tmp_path / "opaque.pt2", _edit_json(CONSTANTS, add),
                    {ROOT + "data/constants/opaque_obj_0": payload})  # fmt: skip


def _library(tmp_path: Path, marker: Path) -> bytes:
    """A shared library whose constructor (run by dlopen) writes ``marker``."""
    source = tmp_path / "hit.c"
    source.write_text(_CONSTRUCTOR % marker)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "hit.so"), str(source)],
                   check=True)  # fmt: skip
    return (tmp_path / "hit.so").read_bytes()


def _first_node_target(model: dict, target: str) -> None:
    model["graph_module"]["graph"]["nodes"][0]["target"] = target


def test_the_opaque_constant_is_live(tmp_path):
    marker = tmp_path / "marker"
    try:
        torch.export.load(_opaque_constant(tmp_path, marker))
    except Exception:  # the payload is no constant of the graph; it ran before that
        pass
    assert marker.exists()


def _refused(path: Path, marker: Path, member: str, **kwargs) -> str:
    """Both entry points refuse ``path`` in one line naming ``member``; nothing ran."""
    messages = []
    for load in (lambda: load_exported(path, **kwargs),
                 lambda: predict(path, torch.ones(1, 4), **kwargs)):  # fmt: skip
        with pytest.raises(ValueError) as info:
            load()
        message = str(info.value)
        assert "\n" not in message and member in message, message
        messages.append(message)
    assert not marker.exists()
    return messages[0]


def test_a_pickled_opaque_constant_is_refused(tmp_path):
    marker = tmp_path / "marker"
    path = _opaque_constant(tmp_path, marker)
    message = _refused(path, marker, "refusing member 'archive/data/constants/")
    assert message.startswith(f"{path}: refusing member")


def test_a_constants_config_declaring_a_pickle_is_refused(tmp_path):
    """The config alone names the pickled entry, whatever member it points to."""
    marker = tmp_path / "marker"

    def pickled(config: dict) -> None:
        config["config"]["c"] = {"path_name": "tensor_0", "is_param": False,
                                 "use_pickle": True, "tensor_meta": None}  # fmt: skip

    path = _rewrite(_exported(tmp_path), tmp_path / "p.pt2", _edit_json(CONSTANTS, pickled), {})
    message = _refused(path, marker, repr(CONSTANTS))
    assert "entry 'c' is pickled" in message


def test_an_aotinductor_library_in_a_pt2_needs_trust(tmp_path):
    marker = tmp_path / "marker"
    library = _library(tmp_path, marker)
    member = ROOT + "data/aotinductor/model/x.wrapper.so"
    path = _rewrite(_exported(tmp_path), tmp_path / "lib.pt2", lambda n, d: d, {member: library})
    for load in (lambda: load_exported(path), lambda: predict(path, torch.ones(1, 4))):
        with pytest.raises(UntrustedPackageError) as info:
            load()
        message = str(info.value)
        assert "\n" not in message and repr(member) in message
        assert message.endswith("with trust=True")
    assert not marker.exists()


@pytest.mark.parametrize("trust", [False, True])
def test_a_member_leaving_the_archive_is_refused_even_when_trusted(tmp_path, trust):
    folder = tmp_path / "inside"
    folder.mkdir()
    marker = tmp_path / "marker"
    member = ROOT + "data/aotinductor/model/../../../../x"
    path = _rewrite(_exported(tmp_path), folder / "slip.pt2", lambda n, d: d, {member: b"x"})
    message = _refused(path, marker, f"refusing member {member!r}", trust=trust)
    assert "would be extracted outside" in message
    assert sorted(p.name for p in folder.iterdir()) == ["slip.pt2"]
    assert not (tmp_path / "x").exists() and not Path("x").exists()


def _evil_expression(tmp_path: Path, marker: Path) -> Path:
    """The exported program with its first shape expression prefixed by a call of
    ``os.system`` that creates ``marker``."""
    evil = f"__import__('os').system('touch {marker}')"

    def change(member: str, data: bytes) -> bytes:
        if member != MODEL:
            return data
        return data.decode().replace('"expr_str": "', f'"expr_str": "{evil} + ', 1).encode()

    path = _rewrite(_exported(tmp_path), tmp_path / "expr.pt2", change, {})
    assert evil in zipfile.ZipFile(path).read(MODEL).decode()
    return path


def test_the_shape_expression_is_live(tmp_path):
    marker = tmp_path / "marker"
    try:
        torch.export.load(_evil_expression(tmp_path, marker))
    except Exception:  # sympy evaluated the call before the sum failed
        pass
    assert marker.exists()


def test_a_shape_expression_that_runs_python_is_refused(tmp_path):
    marker = tmp_path / "marker"
    message = _refused(_evil_expression(tmp_path, marker), marker, repr(MODEL))
    assert "shape expression" in message


def test_a_guard_that_runs_python_is_refused(tmp_path):
    marker = tmp_path / "marker"
    guard = f"__import__('os').system('touch {marker}') == 0"
    path = _rewrite(_exported(tmp_path), tmp_path / "guard.pt2",
                    _edit_json(MODEL, lambda m: m.update(guards_code=[guard])), {})  # fmt: skip
    message = _refused(path, marker, repr(MODEL))
    assert "guard" in message
    # torch alone execs the guard when the module is called
    torch.export.load(path).module()(torch.randn(2, 4))
    assert marker.exists()


def test_a_node_target_outside_torch_operators_is_refused(tmp_path):
    marker = tmp_path / "marker"
    to_system = _edit_json(MODEL, lambda m: _first_node_target(m, "torch.os.system"))
    path = _rewrite(_exported(tmp_path), tmp_path / "target.pt2", to_system, {})
    message = _refused(path, marker, repr(MODEL))
    assert "node target 'torch.os.system'" in message


def test_unknown_members_and_legacy_pickles_are_refused(tmp_path):
    marker = tmp_path / "marker"
    source = _exported(tmp_path)
    for member in ("data/weights/model.pt", "data/constants/custom_obj_0", "notes.txt"):
        path = _rewrite(source, tmp_path / "u.pt2", lambda n, d: d,
                        {ROOT + member: pickle.dumps(payload_object(str(marker)))})  # fmt: skip
        message = _refused(path, marker, repr(ROOT + member))
        assert "not a member of an exported program" in message


def test_the_untouched_program_and_its_guards_still_load(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    static = export_adapted(model, torch.randn(2, 4), tmp_path / "s.pt2", dynamic_batch=False,
                            metadata={"class_names": ["a", "b", "c"]})  # fmt: skip
    program, meta = load_exported(static)
    x = torch.randn(2, 4)
    torch.testing.assert_close(program.module()(x), model(x), atol=0, rtol=0)
    assert meta == {"class_names": ["a", "b", "c"]}
    # A guard torch writes (an input's size) passes the guard grammar.
    path = _rewrite(static, tmp_path / "g.pt2", _edit_json(MODEL, lambda m: m.update(
        guards_code=["L['input'].size()[0] == 2 and L['input'].size()[1] >= 1"])), {})  # fmt: skip
    torch.testing.assert_close(load_exported(path)[0].module()(x), model(x), atol=0, rtol=0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="compile_aot needs a C++ compiler")  # fmt: skip
def test_a_genuine_aot_package_with_its_library_swapped(tmp_path):
    """An AOTInductor package renamed to .pt2, its library replaced: torch.export.load opens
    it (the constructor runs); load_exported refuses it without trust."""
    program, _ = load_exported(_exported(tmp_path))
    package = compile_aot(program, tmp_path / "a.aoti.pt2")
    marker = tmp_path / "marker"
    library = _library(tmp_path, marker)
    swapped = _rewrite(package, tmp_path / "swapped.pt2",
                       lambda n, d: library if n.endswith(".so") else d, {})  # fmt: skip
    with pytest.raises(
        UntrustedPackageError, match="is an AOTInductor package .it holds the library"
    ):
        load_exported(swapped)
    assert not marker.exists()
    try:
        torch.export.load(swapped)
    except Exception:  # the library is no model; its constructor ran before that
        pass
    assert marker.exists()
