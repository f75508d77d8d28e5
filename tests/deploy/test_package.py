"""The package format (`metalearn.deploy.package`): a genuine package round-trips exactly, and
every field, file and tensor a hostile or damaged package could change is refused in one
line naming it, before anything is allocated or run."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from metalearn.deploy import (
    PackageError,
    UntrustedProgramError,
    check_document,
    load_package,
    predict,
    write_package,
)
from metalearn.deploy.package import ARCHITECTURE_ARGUMENTS, DOCUMENT_BYTES
from metalearn.models.backbones import build_backbone
from metalearn.runs.recipe import ModelRecipe
from metalearn.tools import predict as predict_tool
from tests.helpers.packages import SIDE, document, genuine, network, rewrite_document


def _refused(path: Path, match: str, error: type[Exception] = PackageError) -> str:
    with pytest.raises(error) as info:
        load_package(path)
    message = str(info.value)
    assert "\n" not in message and match in message, message
    return message


@pytest.mark.parametrize("norm", ["support", "transductive", "beside_support"])
def test_a_package_round_trips_exactly(tmp_path, norm) -> None:
    path, model = genuine(tmp_path / "p", norm)
    package = load_package(path)
    assert package.norm == norm and package.class_names == ("alpha", "beta", "gamma")
    assert not any(p.requires_grad for p in package.model.parameters())
    x = torch.rand(7, 1, SIDE, SIDE)
    with torch.inference_mode():
        torch.testing.assert_close(package.model(x), model(x), atol=0, rtol=0)
    assert package.document["files"]["weights.safetensors"]["sha256"] == hashlib.sha256(
        (path / "weights.safetensors").read_bytes()).hexdigest()  # fmt: skip


def test_the_schema_names_exactly_the_backbone_constructors_arguments() -> None:
    parameters = inspect.signature(build_backbone).parameters
    keywords = [n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY]
    model_fields = [f.name for f in dataclasses.fields(ModelRecipe) if f.name != "backbone"]
    assert list(ARCHITECTURE_ARGUMENTS) == keywords == model_fields


@pytest.mark.parametrize(
    ("change", "match"),
    [(lambda d: d.update(extra=1), "unknown key 'extra'"),
     (lambda d: d["architecture"]["arguments"].update(groups=2), "unknown key 'groups'"),
     (lambda d: d.pop("norm"), "no 'norm'"),
     (lambda d: d["architecture"]["arguments"].update(ways="3"), "arguments.ways: '3' is not an"),
     (lambda d: d["architecture"]["arguments"].update(ways=True), "ways: True is not an integer"),
     (lambda d: d["image"].update(size=100_000), "image.size: 100000 is out of range (1 to 1024)"),
     (lambda d: d["architecture"]["arguments"].update(hidden=10**6), "hidden: 1000000 is out of"),
     (lambda d: d["architecture"].update(name="os.system"), "name: 'os.system' is none of"),
     (lambda d: d.update(version=2), "format version 2; this metalearn reads version 1"),
     (lambda d: d.update(format="pickle"), "format: 'pickle' is none of metalearn-package"),
     (lambda d: d.update(norm="running"), "norm: 'running' is none of support, transductive"),
     (lambda d: d.update(class_names=["a", "b"]), "class_names holds 2 names, the architecture"),
     (lambda d: d.update(class_names=["a", "a", "b"]), "class_names: a class name appears twice"),
     (lambda d: d.update(class_names=["a\x1b[2J", "b", "c"]), "class_names[0]: 'a\\x1b[2J'"),
     (lambda d: d["image"].update(channels=3), "image.channels 3 but the architecture takes 1"),
     (lambda d: d["files"].update({"../x": {}}), "unknown key '../x'"),
     (lambda d: d["files"]["weights.safetensors"].update(sha256="0" * 63), "is not a SHA-256"),
     (lambda d: d["architecture"]["arguments"].update(dropout=float("inf")), "is not valid JSON")],
)  # fmt: skip
def test_a_document_outside_the_schema_is_one_line(tmp_path, change, match) -> None:
    path, _ = genuine(tmp_path / "p")
    text = json.loads((path / "package.json").read_text())
    change(text)
    (path / "package.json").write_text(json.dumps(text))  # inf: Infinity, which JSON has not
    message = _refused(path, match)
    assert f"{path}/package.json" in message


def test_an_architecture_too_large_is_refused_before_any_memory(tmp_path) -> None:
    path, _ = genuine(tmp_path / "p")

    def huge(d: dict) -> None:  # ResNet-12 at 1024: stages of 10240 channels, 12 GB
        d["architecture"] = {"name": "resnet12", "arguments": {**d["architecture"]["arguments"],
                                                               "hidden": 1024}}  # fmt: skip

    rewrite_document(path, huge)
    _refused(path, "bytes of tensors, more than a package may (2,147,483,648)")
    rewrite_document(path, lambda d: d["architecture"]["arguments"].update(
        hidden=4, activation="leaky_relu"))  # fmt: skip
    _refused(path, "the architecture cannot be built (activation 'leaky_relu' is a setting")
    rewrite_document(path, lambda d: d["architecture"]["arguments"].update(activation="relu"))
    _refused(path, "cannot be built (ResNet12 expects images [B, C, H, W] with H, W >= 16")


def _resave(path: Path, change) -> None:
    """Rewrite the tensor file through ``change(tensors)`` and record its new checksum (what
    an attacker who edits the package does)."""
    weights = path / "weights.safetensors"
    tensors = load(weights.read_bytes())
    change(tensors)
    data = save(tensors)
    weights.write_bytes(data)
    rewrite_document(path, lambda d: d["files"].update({"weights.safetensors": {
        "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}))  # fmt: skip


@pytest.mark.parametrize(
    ("change", "match"),
    [(lambda t: t.pop("head.bias"), "lacks the tensor 'head.bias'"),
     (lambda t: t.update(payload=torch.zeros(1)), "holds the tensor 'payload', which the"),
     (lambda t: t.update({"head.bias": torch.zeros(4)}), "'head.bias' is torch.float32 [4], the"),
     (lambda t: t.update({"head.bias": torch.zeros(3, dtype=torch.float64)}), "torch.float64"),
     (lambda t: t.update({"head.bias": torch.tensor([0.0, float("nan"), 1.0])}), "holds NaN"),
     (lambda t: t.update({"features.0.norm.var": torch.full((4,), float("inf"))}), "NaN or inf")],
)  # fmt: skip
def test_a_tensor_the_architecture_does_not_hold_is_one_line(tmp_path, change, match) -> None:
    path, _ = genuine(tmp_path / "p")
    _resave(path, change)
    _refused(path, match)


def test_the_tensor_file_is_checked_before_it_is_parsed(tmp_path) -> None:
    path, _ = genuine(tmp_path / "p")
    weights = path / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in a weight: the checksum
    weights.write_bytes(bytes(data))
    _refused(path, "its SHA-256 is not the one package.json records")
    weights.write_bytes(bytes(data) + b"x")
    _refused(path, f"more than the {len(data):,} such a file may hold")
    garbage = b"\x10" * len(data)  # not safetensors, with its checksum recorded
    weights.write_bytes(garbage)
    rewrite_document(path, lambda d: d["files"]["weights.safetensors"].update(
        sha256=hashlib.sha256(garbage).hexdigest()))  # fmt: skip
    _refused(path, "weights.safetensors is not a safetensors file (Error while deserializing")
    weights.unlink()
    _refused(path, "tensor file", FileNotFoundError)


def test_files_that_are_not_regular_files_inside_the_folder_are_refused(tmp_path) -> None:
    path, _ = genuine(tmp_path / "p")
    secret = tmp_path / "secret.safetensors"
    (path / "weights.safetensors").rename(secret)
    (path / "weights.safetensors").symlink_to(secret)
    _refused(path, "is a link to", PackageError)
    (path / "weights.safetensors").unlink()
    os.mkfifo(path / "weights.safetensors")  # a blocking open would hang here
    _refused(path, "is a FIFO (named pipe); give a regular file")
    document_path = path / "package.json"
    document_path.rename(tmp_path / "elsewhere.json")
    document_path.symlink_to(tmp_path / "elsewhere.json")
    _refused(path, "package document")
    document_path.unlink()
    document_path.write_text(" " * (DOCUMENT_BYTES + 1))
    _refused(path, f"more than the {DOCUMENT_BYTES:,}")
    document_path.unlink()
    _refused(path, "package.json does not exist", FileNotFoundError)


def test_a_program_file_is_no_package(tmp_path) -> None:
    program = tmp_path / "adapted.pt2"
    program.write_bytes(b"PK\x03\x04 a program")
    _refused(program, "is a file, not a package")
    with pytest.raises(UntrustedProgramError, match="runs code from the file"):
        predict(program, torch.zeros(1, 1, SIDE, SIDE))
    with pytest.raises(FileNotFoundError, match="no package at"):
        load_package(tmp_path / "missing")


def test_write_package_refuses_a_model_its_document_does_not_describe(tmp_path) -> None:
    net, support = network()
    with pytest.raises(PackageError, match=r"'features.0.conv.weight' is torch.float32 \[4, 1, 3"):
        write_package(tmp_path / "p", net, document("transductive", architecture={
            "name": "conv4", "arguments": {**document()["architecture"]["arguments"],
                                           "hidden": 8}}))  # fmt: skip
    with pytest.raises(PackageError, match="lacks the tensor 'features.0.norm.mean'"):
        write_package(tmp_path / "p", net, document("support"))  # not frozen: no statistics
    assert not list(tmp_path.iterdir())
    with pytest.raises(PackageError, match="unknown key 'files'"):
        check_document({**document(), "files": {}}, files=False)


def test_predict_reads_a_package_and_refuses_a_bad_one_in_one_line(tmp_path, capsys) -> None:
    path, model = genuine(tmp_path / "p")
    images = tmp_path / "images"
    images.mkdir()
    from PIL import Image

    for i in range(3):
        Image.fromarray((torch.rand(20, 20) * 255).byte().numpy()).save(images / f"{i}.png")
    assert predict_tool.main(["--model", str(path), "--images", str(images), "--format",
                              "csv"]) == 0  # fmt: skip
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == "file,class,alpha,beta,gamma" and len(rows) == 4
    rewrite_document(path, lambda d: d["image"].update(size="abc"))
    assert predict_tool.main(["--model", str(path), "--images", str(images)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"metalearn-predict: error: {path}/package.json.image.size: 'abc' is not an "
                   "integer"]  # fmt: skip


def test_predict_into_a_reader_that_left_ends_quietly_with_status_141(tmp_path) -> None:
    """``metalearn-predict ... | head``: the JSON's first write fails; no traceback."""
    from PIL import Image

    from tests.tools.test_tools import closed_stdout

    path, _ = genuine(tmp_path / "p")
    images = tmp_path / "images"
    images.mkdir()
    Image.new("L", (SIDE, SIDE), 9).save(images / "a.png")
    done = closed_stdout([sys.executable, "-m", "metalearn.tools.predict", "--model", str(path),
                          "--images", str(images)])  # fmt: skip
    assert (done.returncode, done.stderr) == (141, "")
