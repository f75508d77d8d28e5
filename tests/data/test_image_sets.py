"""Loaders of the few-shot benchmarks, each on a fixture written in its published layout.

Each fixture holds the published number of classes per split with a few tiny images each;
images are checked against Pillow (or the arrays written), split class counts against the
published ones, and every loader's refusals (a wrong class count, missing files) against
the files they name. The real data sets are not on this machine.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from metalearn.data import (
    IMAGE_SET_NAMES,
    ImageSet,
    image_set_samplers,
    load_cifar_fs,
    load_cub,
    load_fc100,
    load_image_folder,
    load_image_set,
    load_mini_imagenet,
    load_tiered_imagenet,
)
from metalearn.data import image_set as image_set_module
from tests.conftest import OMNIGLOT, needs_omniglot
from tests.helpers.image_set_fixtures import (
    CIFAR_FS_SPLIT,
    FC100_SPLIT,
    FINE,
    MINI,
    RNG,
    SUPERCLASS,
    TIERED,
    write_cub,
    write_folder,
    write_mini_csv,
    write_tiered,
)
from tests.helpers.image_set_fixtures import tiered_labels as _tiered_labels
from tests.helpers.image_set_fixtures import write_cifar as _write_cifar


def _pil_rgb(path: Path, size: int) -> np.ndarray:
    """Reference decode: Pillow, RGB, LANCZOS to a square, as [3, S, S]."""
    with Image.open(path) as image:
        image = image.convert("RGB")
        if image.size != (size, size):
            image = image.resize((size, size), Image.Resampling.LANCZOS)
        return np.asarray(image).transpose(2, 0, 1)


def _quiet(load, *args, **kwargs):
    """Load, ignoring the warning that a fixture's classes hold fewer images than published."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return load(*args, **kwargs)


# ---------------------------------------------------------------- mini-ImageNet


@pytest.fixture(scope="module")
def mini_csv(tmp_path_factory) -> Path:
    return write_mini_csv(tmp_path_factory.mktemp("mini-imagenet"))


def test_mini_imagenet_csv_layout(mini_csv, tmp_path):
    with pytest.warns(UserWarning, match=r"do not hold the published 600 images.*holds 2"):
        train = load_mini_imagenet(mini_csv, "train", cache_dir=tmp_path, workers=0)
    assert train.num_classes == 64 and train.images.shape == (128, 3, 84, 84)
    assert train.images.dtype == torch.uint8 and train.counts.tolist() == [2] * 64
    assert list(train.class_names) == sorted(train.class_names)
    first = train.class_names[0]
    assert np.array_equal(
        train.class_images(0)[0].numpy(), _pil_rgb(mini_csv / f"images/{first}00000002.jpg", 84)
    )
    for split, classes in MINI.items():
        assert (
            _quiet(load_mini_imagenet, mini_csv, split, cache_dir=tmp_path).num_classes == classes
        )
    task = train.sampler(ways=5, shots=1, queries=1).sample(torch.Generator().manual_seed(0))
    assert task.support[0].shape == (5, 3, 84, 84) and task.query[1].tolist() == [0, 1, 2, 3, 4]


def test_mini_imagenet_cache_hits_and_sizes(mini_csv, tmp_path, monkeypatch):
    first = _quiet(load_mini_imagenet, mini_csv, "val", cache_dir=tmp_path, workers=0)

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded although the cache should have hit")

    with monkeypatch.context() as patch:
        patch.setattr(image_set_module, "decode_many", no_decoding)
        again = _quiet(load_mini_imagenet, mini_csv, "val", cache_dir=tmp_path)
    assert torch.equal(first.images, again.images) and first.fingerprint == again.fingerprint
    small = _quiet(load_mini_imagenet, mini_csv, "val", cache_dir=tmp_path, image_size=32)
    assert small.images.shape == (32, 3, 32, 32)
    path = mini_csv / f"images/{small.class_names[3]}00000001.jpg"
    assert np.array_equal(small.class_images(3)[1].numpy(), _pil_rgb(path, 32))


def test_mini_imagenet_pickles_give_the_same_set(mini_csv, tmp_path):
    root = tmp_path / "pickles"
    root.mkdir()
    for split, file in (("train", "train"), ("val", "validation"), ("test", "test")):
        reference = _quiet(load_mini_imagenet, mini_csv, split, cache_dir=tmp_path / "c")
        # Rows in another order than the classes: class_dict says which rows are which.
        perm = torch.randperm(len(reference.images), generator=torch.Generator().manual_seed(0))
        data = reference.images[perm].permute(0, 2, 3, 1).numpy()
        where = torch.argsort(perm)  # where[i]: the pickle row of the reference's row i
        class_dict = {
            name: where[int(start) : int(start) + int(count)].tolist()
            for name, start, count in zip(
                reference.class_names, reference.offsets, reference.counts
            )
        }
        with open(root / f"mini-imagenet-cache-{file}.pkl", "wb") as f:
            pickle.dump({"image_data": data, "class_dict": class_dict}, f)
        loaded = _quiet(load_mini_imagenet, root, split)
        assert loaded.class_names == reference.class_names
        assert torch.equal(loaded.images, reference.images)
        assert torch.equal(loaded.counts, reference.counts)


def test_mini_imagenet_refusals(mini_csv, tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_mini_imagenet(tmp_path, "val")
    for needle in ("mini-imagenet-cache-validation.pkl", "images/", "val.csv", "docs/datasets.md"):
        assert needle in str(info.value)
    root = tmp_path / "short"
    (root / "images").mkdir(parents=True)
    rows = (mini_csv / "test.csv").read_text().splitlines()
    (root / "test.csv").write_text("\n".join(rows[:-2]) + "\n")  # the last class's two rows
    for line in rows[1:-2]:
        name = line.split(",")[0]
        (root / "images" / name).write_bytes((mini_csv / "images" / name).read_bytes())
    with pytest.raises(ValueError, match=r"test split: test.csv gives 19 classes, the published"):
        _quiet(load_mini_imagenet, root, "test", cache_dir=tmp_path)
    (root / "test.csv").write_text(rows[0] + "\nmissing.jpg,n1\n")
    with pytest.raises(ValueError, match=r"line 2 names images/missing.jpg, which is missing"):
        load_mini_imagenet(root, "test", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="split='validation'; choose one of train, val, test"):
        load_mini_imagenet(mini_csv, "validation")


# ---------------------------------------------------------------- tiered-ImageNet


@pytest.fixture(scope="module")
def tiered(tmp_path_factory) -> tuple[Path, dict]:
    """val as PNG pickles, test as npz."""
    return write_tiered(tmp_path_factory.mktemp("tiered"), {"val": "png", "test": "npz"})


@pytest.mark.parametrize("split", ["val", "test"])
def test_tiered_imagenet_both_image_files(tiered, tmp_path, split):
    root, arrays = tiered
    with pytest.warns(UserWarning, match=rf"{len(arrays[split])} images, the published split"):
        loaded = load_tiered_imagenet(root, split, cache_dir=tmp_path, workers=0)
    classes, _ = TIERED[split]
    assert loaded.num_classes == classes and loaded.counts.tolist() == [2] * classes
    assert loaded.images.shape == (2 * classes, 3, 84, 84) and loaded.images.dtype == torch.uint8
    assert loaded.class_names[5] == f"n{split}0005"
    # Reference: the written arrays, grouped by label in file order.
    labels = _tiered_labels_written(root, split)
    for c in (0, classes - 1):
        rows = [i for i, label in enumerate(labels) if label == c]
        expected = torch.from_numpy(arrays[split][rows]).permute(0, 3, 1, 2)
        assert torch.equal(loaded.class_images(c), expected)
    task = loaded.sampler(ways=5, shots=1, queries=1).sample(torch.Generator().manual_seed(0))
    assert task.support[0].shape == (5, 3, 84, 84)


def _tiered_labels_written(root: Path, split: str) -> list[int]:
    with open(root / "tiered-imagenet" / f"{split}_labels.pkl", "rb") as f:
        return pickle.load(f)["label_specific"]


def test_tiered_imagenet_refusals(tiered, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"put train_labels.pkl and train_images_png.pkl"):
        load_tiered_imagenet(tiered[0], "train")
    labels = _tiered_labels("train")
    labels["label_specific"] = [c % 350 for c in labels["label_specific"]]
    with open(tmp_path / "train_labels.pkl", "wb") as f:
        pickle.dump(labels, f)
    with pytest.raises(ValueError, match=r"train split: train_labels.pkl gives 350 classes.*351"):
        load_tiered_imagenet(tmp_path, "train")
    labels = _tiered_labels("train")
    labels["label_general"] = [c % 19 for c in labels["label_specific"]]
    with open(tmp_path / "train_labels.pkl", "wb") as f:
        pickle.dump(labels, f)
    with pytest.raises(ValueError, match=r"gives 19 super-categories, the published split has 20"):
        load_tiered_imagenet(tmp_path, "train")
    with open(tmp_path / "train_labels.pkl", "wb") as f:
        pickle.dump(_tiered_labels("train"), f)
    with pytest.raises(FileNotFoundError, match=r"train_images_png.pkl \(or train_images.npz\)"):
        load_tiered_imagenet(tmp_path, "train")


# ---------------------------------------------------------------- CIFAR-FS and FC100


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> Path:
    return _write_cifar(tmp_path_factory.mktemp("cifar"))


def _cifar_rows(root: Path, class_name: str) -> np.ndarray:
    """Reference: the rows of one class, train then test, reshaped as CIFAR documents."""
    rows = []
    for part in ("train", "test"):
        with open(root / "cifar-100-python" / part, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        for row, label in zip(batch[b"data"], batch[b"fine_labels"]):
            if FINE[label] == class_name:
                rows.append(row.reshape(3, 32, 32))
    return np.stack(rows)


@pytest.mark.parametrize(
    "load, counts, member",
    [(load_cifar_fs, (64, 16, 20), ("test", "whale")), (load_fc100, (60, 20, 20), ("val", "wolf"))],
)
def test_cifar_splits(cifar, load, counts, member):
    sets = {split: _quiet(load, cifar, split) for split in ("train", "val", "test")}
    assert tuple(s.num_classes for s in sets.values()) == counts
    names = [set(s.class_names) for s in sets.values()]
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    assert len(names[0] | names[1] | names[2]) == 100
    split, name = member
    image_set = sets[split]
    assert image_set.images.shape == (3 * counts[("train", "val", "test").index(split)], 3, 32, 32)
    assert image_set.images.dtype == torch.uint8 and image_set.counts.tolist()[0] == 3
    index = image_set.class_names.index(name)
    assert np.array_equal(image_set.class_images(index).numpy(), _cifar_rows(cifar, name))
    with pytest.warns(UserWarning, match=r"do not hold the published 600 images.*holds 3"):
        load(cifar, "test")
    task = image_set.sampler(ways=5, shots=1, queries=2).sample(torch.Generator().manual_seed(0))
    assert task.support[0].shape == (5, 3, 32, 32) and task.query[0].shape == (10, 3, 32, 32)


def test_cifar_splits_are_the_published_ones(cifar):
    """Against the lists typed in the fixtures (Bertinetto et al.'s and Oreshkin et al.'s)."""
    for split in ("train", "val", "test"):
        names = _quiet(load_cifar_fs, cifar, split).class_names
        assert names == tuple(sorted(CIFAR_FS_SPLIT[split]))
        names = _quiet(load_fc100, cifar, split).class_names
        assert {SUPERCLASS[c] for c in names} == set(FC100_SPLIT[split])
        assert names == tuple(sorted(c for c in SUPERCLASS if SUPERCLASS[c] in FC100_SPLIT[split]))


def test_cifar_refusals(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cifar-100-python/train, cifar-100-python/test"):
        load_cifar_fs(tmp_path, "train")
    dropped = _write_cifar(tmp_path / "dropped", drop="whale")
    with pytest.raises(
        ValueError, match=r"cifar-fs test split: .* gives 19 classes, the published"
    ):
        _quiet(load_cifar_fs, dropped, "test")
    renamed = _write_cifar(tmp_path / "renamed", rename="whale")
    with pytest.raises(ValueError, match=r"lacks cifar-fs test classes whale"):
        load_cifar_fs(renamed, "test")
    with pytest.raises(ValueError, match=r"fc100 test split: .* gives 19 classes"):
        _quiet(load_fc100, dropped, "test")


# ---------------------------------------------------------------- CUB-200-2011


@pytest.fixture(scope="module")
def cub(tmp_path_factory) -> Path:
    return write_cub(tmp_path_factory.mktemp("cub"))


def test_cub_split_of_chen_et_al(cub, tmp_path):
    sets = {
        s: load_cub(cub, s, image_size=16, cache_dir=tmp_path) for s in ("train", "val", "test")
    }
    assert [s.num_classes for s in sets.values()] == [100, 50, 50]
    # Species 001, 003, ... train; 002, 006, ... validate; 004, 008, ... test.
    assert sets["train"].class_names[:2] == ("001.Bird_1", "003.Bird_3")
    assert sets["val"].class_names[:2] == ("002.Bird_2", "006.Bird_6")
    assert sets["test"].class_names[-1] == "200.Bird_200"
    train = sets["train"]
    assert train.images.shape == (300, 3, 16, 16) and train.counts.tolist() == [3] * 100
    assert sets["val"].counts.tolist() == [2] * 50  # uneven across splits, any size accepted
    photo = cub / "CUB_200_2011/images/003.Bird_3/Bird_3_2.jpg"
    assert np.array_equal(train.class_images(1)[2].numpy(), _pil_rgb(photo, 16))
    task = sets["test"].sampler(ways=5, shots=1, queries=1).sample(torch.Generator().manual_seed(0))
    assert task.support[0].shape == (5, 3, 16, 16)


def test_cub_refusals(cub, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"CUB_200_2011/images/<species>/\*.jpg"):
        load_cub(tmp_path, "train")
    images = tmp_path / "CUB_200_2011" / "images"
    for folder in sorted((cub / "CUB_200_2011" / "images").iterdir())[:199]:
        (images / folder.name).mkdir(parents=True)
    with pytest.raises(ValueError, match=r"holds 199 species folders, CUB-200-2011 has 200"):
        load_cub(tmp_path, "train")


# ---------------------------------------------------------------- image folders


@pytest.fixture
def folder(tmp_path) -> Path:
    return write_folder(tmp_path / "mine")


def test_image_folder_uneven_classes(folder, tmp_path):
    gray = load_image_folder(folder, "val", image_size=12, channels=1, cache_dir=tmp_path)
    assert gray.class_names == ("cat", "dog", "emu") and gray.counts.tolist() == [3, 5, 4]
    assert gray.images.shape == (12, 1, 12, 12) and gray.images.dtype == torch.uint8
    with Image.open(folder / "val/dog/4.png") as image:
        assert np.array_equal(gray.class_images(1)[4, 0].numpy(), np.asarray(image))
    rgb = load_image_folder(folder, "val", image_size=8, cache_dir=tmp_path)
    assert rgb.images.shape == (12, 3, 8, 8)
    sampler = gray.sampler(ways=3, shots=1, queries=2)  # 3 images in the smallest class
    for task in sampler.batch(20, torch.Generator().manual_seed(0)):
        assert task.query[0].shape == (6, 1, 12, 12)
        pool = torch.cat([task.support[0], task.query[0]]).flatten(1)
        assert len({tuple(row.tolist()) for row in pool}) == 9  # no image twice in a task


def test_image_folder_refusals(folder, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"empty/train is missing: an image folder holds"):
        load_image_folder(tmp_path / "empty", "train")
    with pytest.raises(ValueError, match=r"5 \+ 1 = 6 but class 0 \('cat'\) has only 3"):
        load_image_folder(folder, "val", cache_dir=tmp_path).sampler(ways=2, shots=5, queries=1)
    (folder / "val" / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"files beside the class folders \(notes.txt\)"):
        load_image_folder(folder, "val")
    (folder / "test" / "cat" / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"not images \(notes.txt\)"):
        load_image_folder(folder, "test")
    (folder / "train" / "dog" / "4.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"cannot decode .*train/dog/4.png"):
        load_image_folder(folder, "train", cache_dir=tmp_path, workers=0)


# ---------------------------------------------------------------- the entry point


def test_entry_point_loads_by_name_and_augments_training_only(cifar):
    assert set(IMAGE_SET_NAMES) == {
        "mini-imagenet", "tiered-imagenet", "cifar-fs", "fc100", "cub", "folder", "omniglot",
    }  # fmt: skip
    direct = _quiet(load_cifar_fs, cifar, "val")
    named = _quiet(load_image_set, "cifar-fs", cifar, "val")
    assert isinstance(named, ImageSet) and torch.equal(named.images, direct.images)
    kwargs = dict(ways=5, shots=1, queries=2)
    samplers = _quiet(image_set_samplers, "cifar-fs", cifar, augment=True, **kwargs)
    assert set(samplers) == {"train", "val", "test"}
    assert samplers["train"].augment is not None
    assert samplers["val"].augment is None and samplers["test"].augment is None
    plain = _quiet(image_set_samplers, "cifar-fs", cifar, **kwargs)
    assert plain["train"].augment is None
    one = samplers["train"].sample(torch.Generator().manual_seed(0))
    two = plain["train"].sample(torch.Generator().manual_seed(0))
    assert one.support[0].shape == two.support[0].shape == (5, 3, 32, 32)
    assert torch.equal(one.support[1], two.support[1])
    assert not torch.equal(one.query[0], two.query[0])
    with pytest.raises(ValueError, match=r"dataset 'imagenet'; choose one of mini-imagenet"):
        load_image_set("imagenet", cifar, "train")


@needs_omniglot
def test_entry_point_omniglot_keeps_its_tasks():
    from metalearn.data import load_omniglot, omniglot_samplers

    root = OMNIGLOT
    reference = omniglot_samplers(
        load_omniglot(root, progress=False, download=False), ways=5, shots=1, queries=2
    )
    named = image_set_samplers("omniglot", root, ways=5, shots=1, queries=2)
    for split in ("train", "val", "test"):
        a = reference[split].batch(2, torch.Generator().manual_seed(3))
        b = named[split].batch(2, torch.Generator().manual_seed(3))
        assert all(torch.equal(x.query[0], y.query[0]) for x, y in zip(a, b))
    test = load_image_set("omniglot", root, "test")
    assert test.num_classes == 423 and test.images.shape == (423 * 20, 1, 28, 28)


def test_cifar_fs_from_r2d2_release_equals_cifar100(cifar, tmp_path):
    folder = tmp_path / "cifarfs" / "cifar100"
    (folder / "splits" / "bertinetto").mkdir(parents=True)
    for split in ("train", "val", "test"):
        reference = _quiet(load_cifar_fs, cifar, split)
        names = list(reference.class_names)
        lines = [names[i] for i in RNG.permutation(len(names))]  # any order in the list
        (folder / "splits" / "bertinetto" / f"{split}.txt").write_text("\n".join(lines) + "\n")
        for c, name in enumerate(names):
            (folder / "data" / name).mkdir(parents=True)
            for k, image in enumerate(reference.class_images(c)):
                Image.fromarray(image.permute(1, 2, 0).numpy()).save(
                    folder / "data" / name / f"{k:04d}.png"
                )
        loaded = _quiet(load_cifar_fs, tmp_path, split, cache_dir=tmp_path / "cache", workers=0)
        assert loaded.class_names == reference.class_names
        assert torch.equal(loaded.images, reference.images)
    lines = (folder / "splits" / "bertinetto" / "test.txt").read_text().splitlines()
    (folder / "splits" / "bertinetto" / "test.txt").write_text("\n".join(["beaver", *lines[1:]]))
    with pytest.raises(
        ValueError, match=r"test.txt differs from the published CIFAR-FS test split"
    ):
        load_cifar_fs(tmp_path, "test")
    (folder / "splits" / "bertinetto" / "test.txt").write_text("\n".join(lines[1:]))
    with pytest.raises(ValueError, match=r"test split: test.txt gives 19 classes, the published"):
        load_cifar_fs(tmp_path, "test")


def test_fc100_from_metaoptnet_pickles(cifar, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"or FC100_val.pickle \(MetaOptNet's release"):
        load_fc100(tmp_path, "val")
    reference = _quiet(load_fc100, cifar, "val")
    ids = [FINE.index(name) for name in reference.class_names]
    perm = torch.randperm(len(reference.images), generator=torch.Generator().manual_seed(0))
    labels = [ids[c] for c in reference.labels()[perm].tolist()]
    data = reference.images[perm].permute(0, 2, 3, 1).numpy()
    with open(tmp_path / "FC100_val.pickle", "wb") as f:
        pickle.dump({"data": data, "labels": labels}, f)
    loaded = _quiet(load_fc100, tmp_path, "val")
    assert loaded.class_names == tuple(f"label {i}" for i in sorted(ids))
    assert loaded.images.shape == (60, 3, 32, 32) and torch.equal(loaded.counts, reference.counts)
    for c in range(20):  # the same images per class, in the pickle's order
        rows = sorted(torch.nonzero(reference.labels()[perm] == c).flatten().tolist())
        assert torch.equal(loaded.class_images(c), reference.images[perm][rows])
    with open(tmp_path / "FC100_val.pickle", "wb") as f:
        keep = [i for i, label in enumerate(labels) if label != ids[0]]  # one class less
        pickle.dump({"data": data[keep], "labels": [labels[i] for i in keep]}, f)
    with pytest.raises(ValueError, match=r"fc100 val split: FC100_val.pickle gives 19 classes"):
        _quiet(load_fc100, tmp_path, "val")


# ---------------------------------------------------------------- ImageSet and its cache


def test_image_set_groups_by_label_stably_and_checks_itself():
    images = torch.arange(7, dtype=torch.uint8)[:, None, None, None].expand(7, 1, 2, 2)
    labels = torch.tensor([2, 0, 2, 1, 0, 2, 1])
    grouped = ImageSet.from_labels(images, labels, ["a", "b", "c"])
    # Reference: for each class in turn, its images in their original order.
    expected = [i for c in range(3) for i in range(7) if labels[i] == c]
    assert grouped.images[:, 0, 0, 0].tolist() == expected
    assert grouped.counts.tolist() == [2, 2, 3] and grouped.offsets.tolist() == [0, 2, 4]
    assert grouped.labels().tolist() == [0, 0, 1, 1, 2, 2, 2]
    assert grouped.class_images(2)[:, 0, 0, 0].tolist() == [0, 2, 5]
    with pytest.raises(ValueError, match="class 'd' has no images"):
        ImageSet.from_labels(images, labels, ["a", "b", "c", "d"])
    with pytest.raises(ValueError, match=r"7 images has 2 counts summing to 5"):
        ImageSet(images, torch.tensor([2, 3]), ("a", "b"))
    with pytest.raises(ValueError, match=r"must be uint8 \[N, ch, H, W\], got torch.float32"):
        ImageSet(images.float(), torch.tensor([7]), ("a",))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's memory maps")
def test_decoded_cache_is_memory_mapped_and_not_copied_by_the_sampler(folder, tmp_path):
    load_image_folder(folder, "train", image_size=12, cache_dir=tmp_path)  # decodes, caches
    again = load_image_folder(folder, "train", image_size=12, cache_dir=tmp_path)
    (cache,) = tmp_path.glob("folder-12px-*.pt")
    assert str(cache) in Path("/proc/self/maps").read_text()
    sampler = again.sampler(ways=2, shots=1, queries=1)
    assert sampler._rows.data_ptr() == again.images.data_ptr()  # the mapped pages, no copy
