"""A genuine package, mutated thousands of ways (seeded): every case loads correctly or is
refused in one line, and through metalearn-predict exits 0 or 2 with one line; never a
traceback, a hang or a crash. The cases run in a child process with a time limit, so a
crash (a signal) or a hang fails the test instead of taking pytest down.

The families: flipped bytes (the checksum catches them) and flipped bytes with the
checksum recomputed (the parsers and the tensor checks must), flips inside the safetensors
header, truncations, flipped bytes in the JSON (a flip inside a class name is still a valid
package), JSON values replaced by values of every
type and size, keys removed and added, renamed and duplicated files, tensors re-saved with
other shapes and dtypes, and safetensors headers edited (dtype, shape, offsets)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ROOT

CASES = 3000  # in all, over the families
THROUGH_THE_COMMAND = 150  # of which also through metalearn-predict
WEIGHTS, DOCUMENT = "weights.safetensors", "package.json"
VALUES: list[Any] = [0, 1, -1, 2, 3, 4, 12, 1023, 1025, 2**31, 2**63, -(2**63), 10**100, 0.5,
                     -0.0, 1e308, "", "x", "conv4", "resnet12", "support", "float64", "../x",
                     "a" * 5000, None, True, False, [], [1], ["a", "b", "c"], {}, {"a": 1},
                     [[[[[]]]]], "\x00", "\u202e"]  # fmt: skip


def _record_checksum(folder: Path) -> None:
    """Make package.json record the tensor file's real size and SHA-256 (an attacker would)."""
    data = (folder / WEIGHTS).read_bytes()
    tree = json.loads((folder / DOCUMENT).read_text())
    tree["files"][WEIGHTS] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (folder / DOCUMENT).write_text(json.dumps(tree))


def _flip(path: Path, rng: random.Random, count: int, start: int = 0, end: int | None = None):
    data = bytearray(path.read_bytes())
    end = len(data) if end is None else min(end, len(data))
    for _ in range(count):
        data[rng.randrange(start, end)] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def _header_length(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path in a JSON tree (objects' keys, lists' indices)."""
    out = [prefix] if prefix else []
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _paths(v, (*prefix, i))
    return out


def _edit_json(folder: Path, rng: random.Random, how: str) -> None:
    tree = json.loads((folder / DOCUMENT).read_text())
    path = rng.choice(_paths(tree))
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    if how == "replace":
        parent[path[-1]] = rng.choice(VALUES)
    elif how == "delete":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[rng.choice(["extra", "__proto__", "weights.pt", path[-1] + "_"])] = 1
    (folder / DOCUMENT).write_text(json.dumps(tree))


def _resave(folder: Path, rng: random.Random) -> None:
    """One tensor re-saved with another shape or dtype (checksum recorded)."""
    from safetensors.torch import load, save

    tensors = load((folder / WEIGHTS).read_bytes())
    name = rng.choice(sorted(tensors))
    t = tensors[name]
    choice = rng.randrange(5)
    if choice == 0:
        tensors[name] = t.reshape(-1)
    elif choice == 1:
        tensors[name] = t.to(rng.choice([torch.float64, torch.float16, torch.int64, torch.uint8]))
    elif choice == 2:
        tensors[name] = torch.cat([t.reshape(-1), t.reshape(-1)[:1]])
    elif choice == 3:
        tensors[rng.choice(sorted(tensors))] = t.clone()  # another tensor's values and shape
    else:
        tensors[name] = t.reshape(-1).flip(0).reshape(t.shape).contiguous()  # valid, other values
    (folder / WEIGHTS).write_bytes(save(tensors))
    _record_checksum(folder)


def _edit_header(folder: Path, rng: random.Random) -> None:
    """The safetensors header's JSON edited (dtype, shape or offsets), re-padded."""
    data = (folder / WEIGHTS).read_bytes()
    n = _header_length(folder / WEIGHTS)
    header = json.loads(data[8 : 8 + n])
    name = rng.choice([k for k in header if k != "__metadata__"])
    entry = header[name]
    field = rng.choice(["dtype", "shape", "data_offsets"])
    if field == "dtype":
        entry["dtype"] = rng.choice(["F64", "F16", "I64", "U8", "BOOL", "X", "F32"])
    elif field == "shape":
        entry["shape"] = rng.choice([[], [0], [2**40], [-1], entry["shape"][::-1], [1] * 64])
    else:
        a, b = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[b, a], [a, b + 4], [0, 0], [a - 4, b], [a, 2**62]])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    _record_checksum(folder)


def mutate(folder: Path, family: str, rng: random.Random) -> None:
    """Apply one mutation of ``family`` to the package at ``folder``."""
    weights, document = folder / WEIGHTS, folder / DOCUMENT
    if family == "flip":
        _flip(weights, rng, rng.randint(1, 8))
    elif family == "json-flip":
        _flip(document, rng, rng.randint(1, 4))
    elif family == "flip-recorded":
        _flip(weights, rng, rng.randint(1, 8))
        _record_checksum(folder)
    elif family == "flip-header":
        _flip(weights, rng, rng.randint(1, 4), 0, 8 + _header_length(weights))
        _record_checksum(folder)
    elif family == "truncate":
        target = rng.choice([weights, document])
        data = target.read_bytes()
        target.write_bytes(data[: rng.randrange(len(data))])
        if target == weights and rng.random() < 0.5:
            _record_checksum(folder)
    elif family in ("json-replace", "json-delete", "json-add"):
        _edit_json(folder, rng, family.removeprefix("json-"))
    elif family == "rename":
        target = rng.choice([weights, document])
        target.rename(folder / rng.choice(["weights.pt", "model.safetensors", "x", ".hidden"]))
    elif family == "duplicate":
        target = rng.choice([weights, document])
        shutil.copy(target, folder / rng.choice(["copy.safetensors", "package.json.bak", "y"]))
    elif family == "resave":
        _resave(folder, rng)
    elif family == "header":
        _edit_header(folder, rng)
    else:
        raise ValueError(family)


FAMILIES = ("flip", "json-flip", "flip-recorded", "flip-header", "truncate", "json-replace",
            "json-delete", "json-add", "rename", "duplicate", "resave", "header")  # fmt: skip


def fuzz(seed: int, cases: int, through_command: int) -> dict[str, Any]:
    """Run the cases; returns the counts per family and every violation found."""
    from metalearn.deploy import PackageError, load_package, predict
    from metalearn.tools import predict as predict_tool
    from tests.helpers.packages import SIDE, genuine

    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp())
    source, _ = genuine(work / "genuine", rng.choice(["support", "transductive", "beside_support"]))
    images = work / "images"
    images.mkdir()
    from PIL import Image

    Image.new("L", (SIDE, SIDE), 200).save(images / "a.png")
    counts: Counter = Counter()
    violations: list[str] = []
    command_cases = set(rng.sample(range(cases), through_command))
    for case in range(cases):
        family = FAMILIES[case % len(FAMILIES)]
        folder = work / f"case{case}"
        shutil.copytree(source, folder)
        mutate(folder, family, rng)
        try:
            package = load_package(folder)
            counts[family, "loaded"] += 1
            try:  # a loaded package classifies, or names the image whose logits are not finite
                side = package.image.size
                found = predict(package, torch.rand(2, package.image.channels, side, side))
                if found.probabilities.shape != (2, len(package.class_names)):
                    violations.append(f"{family} case {case}: {found.probabilities.shape}")
            except ValueError as err:
                if "logits for image" not in str(err) or "\n" in str(err):
                    violations.append(f"{family} case {case}: predict: {err!r}")
        except (PackageError, FileNotFoundError) as err:
            if "\n" in str(err) or not str(err):
                violations.append(f"{family} case {case}: not one line: {err!r}")
            counts[family, "refused"] += 1
        except Exception as err:  # anything else is a bug
            violations.append(f"{family} case {case}: {type(err).__name__}: {err}")
        if case in command_cases:
            err_text = io.StringIO()
            with contextlib.redirect_stderr(err_text), contextlib.redirect_stdout(io.StringIO()):
                code = predict_tool.main(["--model", str(folder), "--images", str(images)])
            lines = err_text.getvalue().splitlines()
            if code not in (0, 2) or (code == 2 and (len(lines) != 1 or not lines[0].startswith(
                    "metalearn-predict: error: "))) or (code == 0 and lines):  # fmt: skip
                violations.append(f"{family} case {case}: metalearn-predict {code}: {lines}")
            counts["command", code] += 1
        shutil.rmtree(folder)
    shutil.rmtree(work)
    return {"counts": {f"{k[0]}:{k[1]}": v for k, v in counts.items()}, "violations": violations}


@pytest.mark.parametrize("seed", [0, 1])
def test_every_mutated_package_loads_or_is_one_line(seed) -> None:
    call = f"fuzz({seed}, {CASES // 2}, {THROUGH_THE_COMMAND // 2})"
    script = (
        f"import json; from tests.deploy.test_package_fuzz import fuzz; print(json.dumps({call}))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]  # a signal (a crash) is a negative code
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["violations"] == []
    counts = result["counts"]
    for family in FAMILIES:  # every family ran, and each refused what it broke
        assert counts.get(f"{family}:refused", 0) + counts.get(f"{family}:loaded", 0) > 0
    for broken in ("flip", "rename"):  # never a correct package: the checksum, a missing file
        assert counts.get(f"{broken}:loaded", 0) == 0, counts
    assert counts.get("duplicate:loaded", 0) > 0  # an extra file changes nothing
    assert counts.get("command:2", 0) > 0
