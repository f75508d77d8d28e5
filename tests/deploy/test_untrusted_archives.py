"""Files from elsewhere run no code: a hostile pickle reached through a checkpoint's
recorded data root, a ``.pt2`` whose pickled member was replaced, an AOTInductor package
loaded without trust, and one whose member names leave its folder (a zip-slip). Each
payload would create a marker file; each test asserts the file does not exist."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

from metalearn.deploy import export_adapted, load_aot, load_exported, predict
from metalearn.deploy.archive import UntrustedPackageError
from metalearn.tools import evaluate
from tests.helpers.pickle_writers import hidden, payload_object
from tests.helpers.run_helpers import checkpoint_of, fs, make


def _exported(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    return export_adapted(torch.nn.Linear(4, 3), torch.randn(2, 4), tmp_path / "a.pt2")


def _replace_member(path: Path, ending: str, data: bytes) -> Path:
    """A copy of the archive ``path`` with the member ending in ``ending`` replaced."""
    out = path.with_name("tampered.pt2")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        names = src.namelist()
        assert any(n.endswith(ending) for n in names), names
        for name in names:
            dst.writestr(name, data if name.endswith(ending) else src.read(name))
    return out


def _tampered(tmp_path: Path, marker: Path) -> Path:
    buffer = io.BytesIO()
    torch.save((payload_object(str(marker)),), buffer)  # a tuple, as sample inputs are
    return _replace_member(_exported(tmp_path), "data/sample_inputs/model.pt", buffer.getvalue())


def test_the_tampered_pt2_payload_is_live(tmp_path):
    """torch.export.load on its own retries with weights_only=False and runs the payload:
    what the tests below keep from happening."""
    marker = tmp_path / "marker"
    tampered = _tampered(tmp_path, marker)
    try:
        torch.export.load(tampered)
    except Exception:  # the payload's object is no sample input; it ran before that
        pass
    assert marker.exists()


def test_a_tampered_pt2_is_refused_in_one_line_and_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    tampered = _tampered(tmp_path, marker)
    for load in (lambda: load_exported(tampered), lambda: predict(tampered, torch.ones(1, 4))):
        with pytest.raises(ValueError) as info:
            load()
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"{tampered}: refusing a pickled")
        assert "GLOBAL exec was not an allowed global" in message and not marker.exists()
    # The untouched file still loads, and gives its module's logits.
    program, meta = load_exported(tmp_path / "a.pt2")
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    torch.testing.assert_close(program.module()(x), reference(x), atol=0, rtol=0)
    assert meta == {}


def _aot_archive(path: Path, names: list[str]) -> Path:
    """A zip that `is_aot_package` takes for a package: its members' bytes do not matter,
    since every refusal comes before anything is extracted or loaded."""
    with zipfile.ZipFile(path, "w") as archive:
        for name in ["model/data/aotinductor/model/model.so", *names]:
            archive.writestr(name, b"\x7fELF not a library")
    return path


def test_an_aot_package_needs_trust(tmp_path):
    package = _aot_archive(tmp_path / "m.aoti.pt2", [])
    for load in (lambda: load_aot(package), lambda: predict(package, torch.ones(1, 1, 28, 28))):
        with pytest.raises(UntrustedPackageError) as info:
            load()
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"{package} is an AOTInductor package")
        assert "runs the native code" in message and message.endswith("with trust=True")


@pytest.mark.parametrize(
    "member",
    ["../escaped.txt", "model/../../escaped.txt", "/tmp/escaped.txt", "..\\escaped.txt"],
)
def test_a_zip_slip_package_is_refused_even_when_trusted(tmp_path, member):
    folder = tmp_path / "inside"
    folder.mkdir()
    package = _aot_archive(folder / "m.aoti.pt2", [member])
    with pytest.raises(ValueError) as info:
        load_aot(package, trust=True)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{package}: refusing member {member!r}, which would be extracted")
    assert not (tmp_path / "escaped.txt").exists() and sorted(folder.iterdir()) == [package]


def test_a_symlink_member_is_refused(tmp_path):
    package = _aot_archive(tmp_path / "m.aoti.pt2", [])
    with zipfile.ZipFile(package, "a") as archive:
        link = zipfile.ZipInfo("model/link")
        link.external_attr = 0o120777 << 16  # S_IFLNK
        archive.writestr(link, "/etc/passwd")
    with pytest.raises(ValueError, match="refusing member 'model/link'"):
        load_aot(package, trust=True)


@pytest.mark.slow
def test_a_checkpoint_naming_a_folder_of_hostile_pickles_runs_nothing(tmp_path, capsys):
    """The checkpoint itself passes weights_only=True; its recorded data root names a
    mini-ImageNet folder whose pickle would run code: evaluate.py refuses it in one line."""
    marker = tmp_path / "marker"
    data = tmp_path / "mini"
    data.mkdir()
    name, pickled = hidden(str(marker), lambda p: {"image_data": p, "class_dict": {}})
    for split in ("train", "val", "test"):
        (data / f"mini-imagenet-cache-{split}.pkl").write_bytes(pickled)
    args = make(fs, dataset="mini-imagenet", data_root=str(data), out_dir=str(tmp_path / "runs"),
                track=False, device="cpu", hidden=4)  # fmt: skip
    checkpoint = checkpoint_of(tmp_path / "runs", fs, args)
    code = evaluate.main(["--checkpoint", str(checkpoint), "--no-track", "--tasks", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"mini-imagenet-cache-test.pkl: refusing to unpickle {name}" in err[0]
    assert not marker.exists()
