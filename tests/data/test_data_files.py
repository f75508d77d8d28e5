"""Published data files: read without running code from them, checked against their
formats, in every layout people have; the decoded-image cache degrades to running uncached.

Hostile pickles are real payloads (each would create a marker file if executed, which
`test_the_payloads_are_live` shows with Python's own unpickler), written where each loader
reads its data. Layout fixtures are written from class lists typed in
`tests/helpers/image_set_fixtures.py`, apart from the loaders' tables.
"""

from __future__ import annotations

import pickle
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import metalearn
from metalearn.data import (
    load_cifar_fs,
    load_cub,
    load_fc100,
    load_image_folder,
    load_mini_imagenet,
    load_tiered_imagenet,
)
from metalearn.data.cifar import CIFAR100_SUPERCLASSES, CIFAR_FS_CLASSES, FC100_SUPERCLASSES
from metalearn.data.safe_pickle import load_pickle
from tests.helpers.image_set_fixtures import (
    CIFAR_FS_SPLIT,
    FC100_SPLIT,
    FINE,
    SUPERCLASS,
    mini_classes,
    pixels,
    tiered_labels,
    write_cifar,
    write_cifar_torchmeta,
    write_cub,
    write_folder,
    write_mini_cache,
    write_mini_csv,
    write_mini_metaoptnet,
    write_mini_torchmeta,
    write_tiered,
    write_tiered_torchmeta,
)
from tests.helpers.pickle_writers import hidden, numpy1_dumps, payload_object, payloads, py2_dumps


def _quiet(load, *args, **kwargs):
    """Load, ignoring the warning that a fixture's classes hold fewer images than published."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return load(*args, **kwargs)


def _one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def _same(a, b) -> bool:
    """Equal values of the same types (arrays: dtype, shape, memory layout kept or not)."""
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


# Everything the published formats hold, as numpy 2 pickles it.
FORMAT = {
    "image_data": np.arange(2 * 84 * 84 * 3, dtype=np.int64).astype(np.uint8).reshape(2, 84, 84, 3),
    "labels": np.array([3, 1, 2]),
    "strided": np.arange(64, dtype=np.uint8).reshape(8, 8)[:, ::2],
    "fortran": np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
    "names": np.array(["n01440764", "n01443537"]),
    "scalars": [np.int64(7), np.float32(0.5), np.uint8(200)],
    "class_dict": {"n01": [0, 2], "n02": [1]},
    "pngs": [b"\x89PNG\r\n\x1a\n\x00", bytearray(b"\x00\xff")],
    "other": (None, True, 1.5, 2**70, "\u00e9t\u00e9", {1, 2}, frozenset({3})),
}  # fmt: skip


# ---------------------------------------------------------------- the restricted unpickler


@pytest.mark.parametrize("protocol", range(6))
def test_numpy2_pickles_of_every_protocol_load_whole(tmp_path, protocol):
    path = tmp_path / "data.pkl"
    path.write_bytes(pickle.dumps(FORMAT, protocol=protocol))
    assert _same(load_pickle(path), FORMAT)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_numpy1_pickles_load_whole(tmp_path, protocol):
    data = numpy1_dumps(FORMAT, protocol)
    assert b"numpy.core.multiarray" in data and b"numpy._core" not in data
    (tmp_path / "data.pkl").write_bytes(data)
    assert _same(load_pickle(tmp_path / "data.pkl"), FORMAT)


def test_python2_pickles_load_with_latin1_strings_or_bytes(tmp_path):
    archive = {"data": FORMAT["image_data"], "labels": [64, 65], "catname2label": {"n01": 64}}
    data = py2_dumps(archive)
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in data and b"U\x04data" in data
    (tmp_path / "py2.pkl").write_bytes(data)
    assert _same(load_pickle(tmp_path / "py2.pkl"), archive)
    as_bytes = load_pickle(tmp_path / "py2.pkl", encoding="bytes")
    assert set(as_bytes) == {b"data", b"labels", b"catname2label"}
    assert np.array_equal(as_bytes[b"data"], archive["data"])


def test_the_payloads_are_live(tmp_path):
    marker = tmp_path / "marker"
    for data in payloads(str(marker), protocol=2).values():
        pickle.loads(data)  # Python's own unpickler runs it
        assert marker.exists()
        marker.unlink()


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_refused_names_run_nothing_and_are_named_in_one_line(tmp_path, protocol):
    marker = tmp_path / "marker"
    for name, data in payloads(str(marker), protocol).items():
        path = tmp_path / "data.pkl"
        path.write_bytes(data)
        with pytest.raises(ValueError) as info:
            load_pickle(path)
        message = _one_line(info)
        assert message.startswith(f"{path}: refusing to unpickle {name}:"), message
        assert not marker.exists()


def test_only_latin1_codecs_and_no_persistent_ids(tmp_path):
    path = tmp_path / "data.pkl"
    path.write_bytes(b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x05\x00\x00\x00rot13\x86R.")
    with pytest.raises(ValueError, match=r"data.pkl is not a readable pickle .*rot13"):
        load_pickle(path)
    path.write_bytes(b"\x80\x02X\x01\x00\x00\x00xQ.")  # BINPERSID
    with pytest.raises(ValueError, match=r"refusing to unpickle persistent id 'x'"):
        load_pickle(path)
    path.write_bytes(pickle.dumps(FORMAT, protocol=4)[:-50])
    with pytest.raises(ValueError, match=r"data.pkl is not a readable pickle \(.*\); it is trunc"):
        load_pickle(path)


def test_nothing_else_in_the_package_unpickles():
    package = Path(metalearn.__file__).parent
    for path in package.rglob("*.py"):
        if path.name == "safe_pickle.py":
            continue
        text = path.read_text()
        assert not re.search(r"pickle\.(load|loads|Unpickler)\b", text), path
        assert "allow_pickle=True" not in text and "weights_only=False" not in text, path


# ---------------------------------------------------------------- hostile data files


def _hostile_cases(root: Path) -> list[tuple[Path, object, object]]:
    """(file written, the load that reads it, the container the payload hides in)."""
    tiered = root / "tiered"
    tiered.mkdir()
    with open(tiered / "val_labels.pkl", "wb") as f:
        pickle.dump(tiered_labels("val"), f)
    cifar = write_cifar(root / "cifar")
    return [
        (root / "mini-imagenet-cache-train.pkl", lambda: load_mini_imagenet(root, "train"),
         lambda p: {"image_data": p, "class_dict": {}}),
        (root / "miniImageNet_category_split_val.pickle", lambda: load_mini_imagenet(root, "val"),
         lambda p: {"data": p, "labels": [], "catname2label": {}}),
        (tiered / "test_labels.pkl", lambda: load_tiered_imagenet(tiered, "test"),
         lambda p: {"label_specific": [p]}),
        (tiered / "val_images_png.pkl", lambda: load_tiered_imagenet(tiered, "val", workers=0),
         lambda p: [p]),
        (cifar / "cifar-100-python" / "meta", lambda: load_cifar_fs(cifar, "test"),
         lambda p: {b"fine_label_names": p}),
        (cifar / "cifar-100-python" / "train", lambda: load_fc100(cifar, "val"),
         lambda p: {b"data": p}),
        (root / "FC100_test.pickle", lambda: load_fc100(root, "test"), lambda p: {"data": p}),
        (root / "CIFAR_FS_val.pickle", lambda: load_cifar_fs(root, "val"), lambda p: [p]),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(8))
def test_hostile_pickles_as_data_files_run_nothing(tmp_path, case):
    marker = tmp_path / "marker"
    path, load, wrap = _hostile_cases(tmp_path)[case]
    name, data = hidden(str(marker), wrap)
    path.write_bytes(data)
    with pytest.raises(ValueError) as info:
        load()
    message = _one_line(info)
    assert message.startswith(f"{path}: refusing to unpickle {name}:") and not marker.exists()
    for name, data in payloads(str(marker), protocol=4).items():  # the payload alone
        path.write_bytes(data)
        with pytest.raises(ValueError, match=re.escape(f"{path}: refusing to unpickle {name}")):
            load()
        assert not marker.exists()


def test_an_npz_holding_pickled_objects_is_refused(tmp_path):
    marker = tmp_path / "marker"
    folder = tmp_path / "tiered"
    folder.mkdir()
    with open(folder / "val_labels.pkl", "wb") as f:
        pickle.dump(tiered_labels("val"), f)
    images = np.empty(2, dtype=object)
    images[0] = payload_object(str(marker))  # np.savez pickles it into the .npy
    np.savez(folder / "val_images.npz", images=images)
    with pytest.raises(ValueError) as info:
        load_tiered_imagenet(folder, "val")
    assert re.match(rf"{re.escape(str(folder))}/val_images.npz is not a readable npz of arrays "
                    r"\(Object arrays cannot be loaded when allow_pickle=False\)",
                    _one_line(info))  # fmt: skip
    assert not marker.exists()


# ---------------------------------------------------------------- validated arrays


def _mini_cache(root: Path, image_data, class_dict) -> Path:
    root.mkdir(exist_ok=True)
    path = root / "mini-imagenet-cache-test.pkl"
    with open(path, "wb") as f:
        pickle.dump({"image_data": image_data, "class_dict": class_dict}, f)
    return path


GOOD = np.zeros((4, 84, 84, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    ("image_data", "class_dict", "message"),
    [
        (GOOD, {"n1": [-1, 0], "n2": [1]}, r"class_dict\['n1'\] holds -1, which is negative"),
        (GOOD, {"n1": [0, 4], "n2": [1]}, r"class 'n1' lists row 4, but image_data holds 4 "),
        (GOOD, {"n1": [0, 1], "n2": [1, 2]}, r"row 1 is listed more than once \(under 'n1', 'n2'"),
        (GOOD, {"n1": [0, 0], "n2": [1]}, r"row 0 is listed more than once \(under 'n1'\)"),
        (GOOD, {"n1": [0, 1], "n2": []}, r"class 'n2' lists no rows"),
        (GOOD, {"n1": [0.0, 1.0]}, r"class_dict\['n1'\] must be a list of integers, got float64"),
        (GOOD, [[0, 1]], r"class_dict must be a non-empty dict .* got list"),
        (GOOD, {3: [0]}, r"class_dict has the non-string class name 3"),
        (np.zeros((4, 10, 10, 3), np.uint8), {"n1": [0]},
         r"image_data must be uint8 \[N, 84, 84, 3\], got uint8 \[4, 10, 10, 3\]"),
        (GOOD.astype(np.float32) + 300.7, {"n1": [0]},
         r"image_data must be uint8 \[N, 84, 84, 3\], got float32"),
    ],
)  # fmt: skip
def test_mini_imagenet_cache_is_checked_row_by_row(tmp_path, image_data, class_dict, message):
    path = _mini_cache(tmp_path, image_data, class_dict)
    with pytest.raises(ValueError) as info:
        load_mini_imagenet(tmp_path, "test")
    assert re.match(re.escape(f"{path}: ") + message, _one_line(info)), str(info.value)


def test_mini_imagenet_csv_rows_and_metaoptnet_labels_are_checked(tmp_path):
    root = write_mini_csv(tmp_path / "csv")
    lines = (root / "val.csv").read_text().splitlines()
    (root / "val.csv").write_text("\n".join([*lines, lines[3]]) + "\n")
    with pytest.raises(ValueError, match=rf"val.csv line {len(lines) + 1} repeats images/"):
        load_mini_imagenet(root, "val", cache_dir=tmp_path / "c")
    meta = tmp_path / "metaoptnet"
    write_mini_metaoptnet(meta)
    path = meta / "miniImageNet_category_split_test.pickle"
    archive = load_pickle(path)
    for change, message in (
        ({"labels": archive["labels"][:-1]}, r"labels holds \d+ labels for \d+ images"),
        ({"catname2label": {"n1": 80}}, r"labels holds 81, which catname2label does not name"),
        ({"catname2label": {"n1": 80, "n2": 80}}, r"catname2label gives label 80 to both 'n1'"),
        ({"data": archive["data"][:, :32]}, r"data must be uint8 \[N, 84, 84, 3\]"),
    ):
        path.write_bytes(py2_dumps({**archive, **change}))
        with pytest.raises(ValueError) as info:
            load_mini_imagenet(meta, "test")
        assert re.match(re.escape(f"{path}: ") + message, _one_line(info)), str(info.value)


def test_tiered_imagenet_labels_and_images_are_checked(tmp_path):
    root, arrays = write_tiered(tmp_path / "t", {"val": "png", "test": "npz"})
    folder = root / "tiered-imagenet"
    good = tiered_labels("val")
    path = folder / "val_labels.pkl"
    wrong_super = list(good["label_general"])
    first = good["label_specific"].index(0)
    wrong_super[first] = (wrong_super[first] + 1) % 6
    for labels, message in (
        ([1, 2], r"expected a dict with label_specific and label_general, got list"),
        ({**good, "label_specific": [float(c) for c in good["label_specific"]]},
         r"label_specific must be a list of integers, got float64"),
        ({**good, "label_general": good["label_general"][:-1]}, r"label_general holds 193 labels"),
        ({**good, "label_general": wrong_super}, r"class 0 has images under two super-categories"),
        ({**good, "label_specific_str": [1] * 97}, r"label_specific_str must be a list of"),
    ):  # fmt: skip
        with open(path, "wb") as f:
            pickle.dump(labels, f)
        with pytest.raises(ValueError) as info:
            load_tiered_imagenet(root, "val", cache_dir=tmp_path / "c", workers=0)
        assert re.match(re.escape(f"{path}: ") + message, _one_line(info)), str(info.value)
    npz = folder / "test_images.npz"
    for images in (arrays["test"].astype(np.float32), arrays["test"][:, :42]):
        np.savez(npz, images=images)
        with pytest.raises(ValueError, match=re.escape(f"{npz}: images must be uint8 [N, 84, 84")):
            load_tiered_imagenet(root, "test")


@pytest.mark.parametrize("workers", [0, 2])
def test_tiered_png_of_another_size_or_corrupt_is_named_by_file_and_index(tmp_path, workers):
    root, _ = write_tiered(tmp_path / "t", {"val": "png"})
    pngs = root / "tiered-imagenet" / "val_images_png.pkl"
    with open(pngs, "rb") as f:
        encoded = pickle.load(f)  # the fixture's own file
    small = np.frombuffer(_png(pixels(10, 10)), dtype=np.uint8)
    for index, item, message in (
        (17, small, r"is 10x10 pixels, the published images are 84x84"),
        (5, b"not a png", r"cannot decode an encoded image"),
        (9, 3.5, r"is a float, not PNG bytes"),
    ):
        with open(pngs, "wb") as f:
            pickle.dump([item if i == index else e for i, e in enumerate(encoded)], f)
        with pytest.raises(ValueError) as info:
            load_tiered_imagenet(root, "val", cache_dir=tmp_path / "c", workers=workers)
        assert re.match(rf"{re.escape(str(pngs))} image {index}\b.*{message}", _one_line(info))


def _png(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_cifar_arrays_are_checked_not_cast(tmp_path):
    root = tmp_path / "metaoptnet"
    root.mkdir()
    path = root / "FC100_test.pickle"
    data = np.full((40, 32, 32, 3), 300.7)
    labels = [i // 2 for i in range(40)]
    for archive, message in (
        ({"data": data, "labels": labels}, r"data must be uint8 \[N, 32, 32, 3\], got float64"),
        ({"data": data.astype(np.uint8), "labels": [0.5] * 40},
         r"labels must be a list of integers, got float64"),
        ({"data": data.astype(np.uint8), "labels": labels[:-1]}, r"labels holds 39 labels for 40"),
    ):  # fmt: skip
        path.write_bytes(py2_dumps(archive))
        with pytest.raises(ValueError) as info:
            load_fc100(root, "test")
        assert re.match(re.escape(f"{path}: ") + message, _one_line(info)), str(info.value)
    cifar = write_cifar(tmp_path / "cifar")
    train = cifar / "cifar-100-python" / "train"
    with open(train, "rb") as f:
        batch = pickle.load(f)  # the fixture's own file
    whale = FINE.index("whale")
    moved = [1 if f == whale else c for f, c in zip(batch[b"fine_labels"], batch[b"coarse_labels"])]
    for change, message in (
        ({b"data": batch[b"data"].astype(np.float64)}, r"data must be uint8 \[N, 3072\]"),
        ({b"fine_labels": [100] * len(moved)}, r"labels beyond CIFAR-100's 100 classes"),
        ({b"coarse_labels": moved},
         r"images of 'whale' are labelled super-class 'fish', CIFAR-100 has it under "
         r"'aquatic_mammals'"),
    ):  # fmt: skip
        with open(train, "wb") as f:
            pickle.dump({**batch, **change}, f)
        with pytest.raises(ValueError) as info:
            load_fc100(cifar, "test")
        assert re.match(re.escape(f"{train}: ") + message, _one_line(info)), str(info.value)


def test_r2d2_png_of_another_size_and_misnumbered_cub_are_refused(tmp_path):
    folder = tmp_path / "cifarfs" / "cifar100"
    (folder / "splits" / "bertinetto").mkdir(parents=True)
    (folder / "splits" / "bertinetto" / "val.txt").write_text("\n".join(CIFAR_FS_SPLIT["val"]))
    for name in CIFAR_FS_SPLIT["val"]:
        (folder / "data" / name).mkdir(parents=True)
        size = 16 if name == "shark" else 32
        Image.fromarray(pixels(size, size)).save(folder / "data" / name / "0.png")
    with pytest.raises(ValueError) as info:
        load_cifar_fs(tmp_path, "val", cache_dir=tmp_path / "c", workers=0)
    shark = re.escape(str(folder / "data" / "shark" / "0.png"))
    assert re.match(rf"{shark} is 16x16 pixels, the published images are 32x32", _one_line(info))
    cub = write_cub(tmp_path / "cub")
    images = cub / "CUB_200_2011" / "images"
    (images / "200.Bird_200").rename(images / "300.Bird_200")
    with pytest.raises(ValueError, match=r"species folder '300.Bird_200' breaks CUB-200-2011's"):
        load_cub(cub, "train")


# ---------------------------------------------------------------- the layouts people have


def _equals_mini_fixture(image_set, split: str) -> None:
    classes = mini_classes(split)  # the arrays every layout was written from
    assert image_set.class_names == tuple(sorted(classes))
    for c, name in enumerate(image_set.class_names):
        expected = torch.from_numpy(classes[name]).permute(0, 3, 1, 2)
        assert torch.equal(image_set.class_images(c), expected)


@pytest.mark.parametrize(
    "write",
    [
        lambda root: write_mini_cache(root, validation="val"),  # Ren et al.'s / torchmeta's
        lambda root: write_mini_cache(root, validation="validation"),  # learn2learn's
        write_mini_metaoptnet,
        write_mini_torchmeta,
    ],
    ids=["ren", "learn2learn", "metaoptnet", "torchmeta"],
)
def test_mini_imagenet_layouts_give_the_published_classes(tmp_path, write):
    root = write(tmp_path / "mini")
    for split in ("train", "val", "test"):
        with pytest.warns(UserWarning, match="do not hold the published 600 images"):
            image_set = load_mini_imagenet(root, split)
        assert image_set.num_classes == {"train": 64, "val": 16, "test": 20}[split]
        _equals_mini_fixture(image_set, split)
    with pytest.raises(ValueError, match=r"holds 84x84 images; use image_size=84"):
        load_mini_imagenet(root, "test", image_size=32)


def test_torchmeta_mini_imagenet_from_its_folder_and_checked(tmp_path):
    root = write_mini_torchmeta(tmp_path / "tm")
    _equals_mini_fixture(_quiet(load_mini_imagenet, root / "miniimagenet", "val"), "val")
    listing = root / "miniimagenet" / "val_labels.json"
    listing.write_text(listing.read_text().replace('"n0', '"x0', 1))
    with pytest.raises(ValueError, match=r"val_data.hdf5 has no datasets/x0"):
        load_mini_imagenet(root, "val")
    (root / "miniimagenet" / "test_labels.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"test_labels.json is missing beside test_data"):
        load_mini_imagenet(root, "test")


def test_torchmeta_tiered_imagenet_equals_rens_release(tmp_path):
    ren, _ = write_tiered(tmp_path / "ren", {"val": "png"})
    root = write_tiered_torchmeta(ren, tmp_path / "tm", "val")
    reference = _quiet(load_tiered_imagenet, ren, "val", cache_dir=tmp_path / "c", workers=0)
    loaded = _quiet(load_tiered_imagenet, root, "val", cache_dir=tmp_path / "c", workers=0)
    assert loaded.class_names == reference.class_names
    assert torch.equal(loaded.counts, reference.counts)
    assert torch.equal(loaded.images, reference.images)
    assert loaded.fingerprint != reference.fingerprint  # cached apart: other source files


@pytest.mark.parametrize(("load", "name"), [(load_cifar_fs, "cifar-fs"), (load_fc100, "fc100")])
def test_torchmeta_cifar_equals_cifar100s_release_and_the_typed_splits(tmp_path, load, name):
    cifar = write_cifar(tmp_path / "cifar")
    root = write_cifar_torchmeta(cifar, tmp_path / "tm")
    for split in ("train", "val", "test"):
        reference = _quiet(load, cifar, split)
        loaded = _quiet(load, root, split)
        assert loaded.class_names == reference.class_names
        assert torch.equal(loaded.images, reference.images)
        assert torch.equal(loaded.counts, reference.counts)
        typed = (
            CIFAR_FS_SPLIT[split]
            if name == "cifar-fs"
            else [c for c in FINE if SUPERCLASS[c] in FC100_SPLIT[split]]
        )
        assert set(loaded.class_names) == set(typed)
    listing = root / "cifar100" / name / "test_labels.json"
    listing.write_text(listing.read_text().replace('"baby"', '"beaver"', 1))
    with pytest.raises(ValueError, match=rf"test_labels.json differs from the published {name}"):
        load(root, "test")


def test_loader_tables_equal_the_typed_published_lists():
    assert {c: set(fs) for c, fs in CIFAR100_SUPERCLASSES.items()} == {
        c: {f for f in FINE if SUPERCLASS[f] == c} for c in set(SUPERCLASS.values())
    }
    for split in ("train", "val", "test"):
        assert CIFAR_FS_CLASSES[split] == tuple(sorted(CIFAR_FS_SPLIT[split]))
        assert set(FC100_SUPERCLASSES[split]) == set(FC100_SPLIT[split])
    assert [len(CIFAR_FS_SPLIT[s]) for s in ("train", "val", "test")] == [64, 16, 20]


def test_cifar_fs_from_metaoptnet_pickles(tmp_path):
    cifar = write_cifar(tmp_path / "cifar")
    reference = _quiet(load_cifar_fs, cifar, "val")
    ids = [FINE.index(name) for name in reference.class_names]
    labels = [ids[c] for c in reference.labels().tolist()]
    data = reference.images.permute(0, 2, 3, 1).numpy()
    (tmp_path / "CIFAR_FS_val.pickle").write_bytes(py2_dumps({"data": data, "labels": labels}))
    loaded = _quiet(load_cifar_fs, tmp_path, "val")
    assert loaded.class_names == tuple(f"label {i}" for i in sorted(ids))
    assert torch.equal(loaded.images, reference.images)


def test_learn2learn_cub_root(tmp_path):
    root = write_cub(tmp_path / "l2l", folder="cubirds200/CUB_200_2011")
    loaded = load_cub(root, "val", image_size=16, cache_dir=tmp_path / "c")
    assert loaded.num_classes == 50 and loaded.class_names[0] == "002.Bird_2"


def test_hdf5_without_h5py_names_the_extra(tmp_path, monkeypatch):
    mini = write_mini_torchmeta(tmp_path / "mini")
    tiered = write_tiered_torchmeta(write_tiered(tmp_path / "ren", {"val": "png"})[0],
                                    tmp_path / "tiered", "val")  # fmt: skip
    cifar = write_cifar_torchmeta(write_cifar(tmp_path / "cifar"), tmp_path / "tm")
    monkeypatch.setitem(sys.modules, "h5py", None)  # as if not installed: import fails
    for load, root in ((load_mini_imagenet, mini), (load_tiered_imagenet, tiered),
                       (load_cifar_fs, cifar), (load_fc100, cifar)):  # fmt: skip
        with pytest.raises(ImportError) as info:
            load(root, "val")
        assert re.match(r"reading \S+data.hdf5 needs h5py, .* pip install metalearn\[h5\]",
                        _one_line(info))  # fmt: skip


def test_a_damaged_hdf5_file_is_one_line(tmp_path):
    root = write_mini_torchmeta(tmp_path / "tm")
    path = root / "miniimagenet" / "val_data.hdf5"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as info:
        load_mini_imagenet(root, "val")
    assert _one_line(info).startswith(str(path))


# ---------------------------------------------------------------- the decoded cache


def _unwritable_cache(tmp_path: Path) -> Path:
    """A cache folder that cannot be made: its parent is a file (even root cannot)."""
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "cache"


def test_an_unwritable_cache_runs_uncached_with_a_warning(tmp_path):
    folder = write_folder(tmp_path / "mine")
    reference = load_image_folder(folder, "val", image_size=12, cache_dir=tmp_path / "ok")
    cache = _unwritable_cache(tmp_path)
    with pytest.warns(UserWarning) as record:
        loaded = load_image_folder(folder, "val", image_size=12, cache_dir=cache)
    (warning,) = [str(w.message) for w in record]
    assert re.match(rf"could not write the folder cache {re.escape(str(cache))}/folder-12px-"
                    r"\w+\.pt: Not a directory; .*\(nothing was replaced\); running uncached",
                    warning)  # fmt: skip
    assert torch.equal(loaded.images, reference.images) and loaded.counts.tolist() == [3, 5, 4]


@pytest.mark.skipif(sys.platform == "win32", reason="file-size limits are POSIX")
def test_a_full_disk_runs_uncached_with_a_warning(tmp_path):
    import resource

    folder = write_folder(tmp_path / "mine")
    reference = load_image_folder(folder, "val", image_size=84, cache_dir=tmp_path / "ok")
    cache = tmp_path / "full"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # A write past 64 KiB fails as on a full disk (EFBIG; Python ignores SIGXFSZ); the
    # decoded cache is 12 x 3 x 84 x 84 bytes = 254 KB.
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.warns(UserWarning, match=r"could not write the folder cache .*: File too "
                          r"large; .*running uncached"):  # fmt: skip
            loaded = load_image_folder(folder, "val", image_size=84, cache_dir=cache)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert torch.equal(loaded.images, reference.images)
    assert list(cache.iterdir()) == []  # no partial cache file left behind


# ---------------------------------------------------------------- through the experiments


def test_a_corrupt_omniglot_drawing_is_one_line_in_the_experiment(tmp_path):
    from metalearn.runs.lifecycle import UserError
    from tests.helpers.run_helpers import make, om, samplers_of

    drawing = tmp_path / "omniglot" / "images_background" / "A" / "character01" / "0001_01.png"
    drawing.parent.mkdir(parents=True)
    drawing.write_bytes(b"not a png")
    other = tmp_path / "omniglot" / "images_evaluation" / "B" / "character01" / "0002_01.png"
    other.parent.mkdir(parents=True)
    Image.fromarray(np.zeros((105, 105), bool)).save(other)
    with pytest.raises(UserError) as info:
        samplers_of(om, make(om, data_root=str(tmp_path / "omniglot")))
    assert re.match(rf"cannot decode {re.escape(str(drawing))} \(", _one_line(info))


class _ForgedDtype:
    """Pickles as ``numpy.dtype('V8', False, True)`` with ``state`` as its BUILD state."""

    def __init__(self, state: tuple) -> None:
        self.state = state

    def __reduce__(self) -> tuple:
        return (np.dtype, ("V8", False, True), self.state)


@pytest.mark.parametrize(
    ("state", "why"),
    [((3, "|", None, None, None, 8, 1, 63), "hand-built dtype state"),  # NPY_ITEM_HASOBJECT...
     ((3, "|", None, None, None, -1, -1, 1), "hand-built dtype state"),  # ...and a size of -1
     ((3, "|", None, ("a",), {"a": (np.dtype("i8"), 0)}, 8, 1, 17), "hand-built dtype state"),
     ((2, "|", None, None, None, 8, 1, 0), "dtype state"), ((3, "!", None, None, None, 8, 1, 0),
     "byte order")],
)  # fmt: skip
def test_a_forged_dtype_state_is_refused(tmp_path, state, why):
    """Plain pickle gives an array whose void field numpy reads as object pointers (a wild
    pointer: a crash on read); load_pickle refuses the state before any array uses it."""
    array = np.frombuffer(b"\x41" * 16, np.uint8)
    forged = pickle.dumps({"image_data": array, "dtype": _ForgedDtype(state)})
    if state[-1] == 63:
        assert pickle.loads(forged)["dtype"].hasobject  # what numpy's __setstate__ makes of it
    path = tmp_path / "forged.pkl"
    path.write_bytes(forged)
    with pytest.raises(ValueError, match=f"forged.pkl: refusing to unpickle .*{why}") as info:
        load_pickle(path)
    assert "\n" not in str(info.value)


def test_object_dtypes_are_refused_and_plain_structured_ones_load(tmp_path):
    path = tmp_path / "objects.pkl"
    path.write_bytes(pickle.dumps(np.array([None, 1], dtype=object)))
    with pytest.raises(
        ValueError, match=r"refusing to unpickle the dtype dtype\('O'\) \(Python objects\)"
    ):
        load_pickle(path)
    record = np.dtype([("a", "<f4"), ("b", ">i8"), ("c", "<u1", (2, 3))])
    plain = np.arange(3 * record.itemsize, dtype=np.uint8).view(record)
    for protocol in (2, 5):
        path.write_bytes(pickle.dumps({"x": plain, "s": np.float32(2.5)}, protocol=protocol))
        loaded = load_pickle(path)
        assert loaded["x"].dtype == record and loaded["x"].tobytes() == plain.tobytes()
        assert loaded["s"] == np.float32(2.5)
