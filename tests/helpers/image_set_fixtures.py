"""Writers of each image benchmark in its published layouts, tiny: for the loader tests and
the experiment's end-to-end runs.

Each writer puts the published number of classes per split on disk with two or three
small random images each, in the files and folders the real release has. The class lists
are typed here from the publications, apart from the loaders' own tables, so a test that
loads a fixture checks the loaders' tables too: CIFAR-100's super-classes (its ``meta``
file), Bertinetto et al.'s CIFAR-FS split (R2-D2's ``splits/bertinetto/*.txt``) and
Oreshkin et al.'s FC100 super-class split (TADAM's supplementary material).
"""

from __future__ import annotations

import csv
import io
import json
import pickle
from pathlib import Path

import numpy as np
from PIL import Image

from tests.helpers.pickle_writers import py2_dumps

RNG = np.random.default_rng(0)
MINI = {"train": 64, "val": 16, "test": 20}
TIERED = {"train": (351, 20), "val": (97, 6), "test": (160, 8)}

# CIFAR-100's 20 super-classes, each with its 5 classes (https://www.cs.toronto.edu/~kriz/cifar.html).
_CIFAR100 = """
aquatic_mammals: beaver dolphin otter seal whale
fish: aquarium_fish flatfish ray shark trout
flowers: orchid poppy rose sunflower tulip
food_containers: bottle bowl can cup plate
fruit_and_vegetables: apple mushroom orange pear sweet_pepper
household_electrical_devices: clock keyboard lamp telephone television
household_furniture: bed chair couch table wardrobe
insects: bee beetle butterfly caterpillar cockroach
large_carnivores: bear leopard lion tiger wolf
large_man-made_outdoor_things: bridge castle house road skyscraper
large_natural_outdoor_scenes: cloud forest mountain plain sea
large_omnivores_and_herbivores: camel cattle chimpanzee elephant kangaroo
medium_mammals: fox porcupine possum raccoon skunk
non-insect_invertebrates: crab lobster snail spider worm
people: baby boy girl man woman
reptiles: crocodile dinosaur lizard snake turtle
small_mammals: hamster mouse rabbit shrew squirrel
trees: maple_tree oak_tree palm_tree pine_tree willow_tree
vehicles_1: bicycle bus motorcycle pickup_truck train
vehicles_2: lawn_mower rocket streetcar tank tractor
"""
SUPERCLASS = {
    fine: coarse
    for line in _CIFAR100.strip().splitlines()
    for coarse, fines in [line.split(":")]
    for fine in fines.split()
}
FINE = sorted(SUPERCLASS)  # CIFAR-100's label order: alphabetical
COARSE = sorted(set(SUPERCLASS.values()))
# Bertinetto et al.'s CIFAR-FS split (R2-D2's splits/bertinetto/{train,val,test}.txt).
CIFAR_FS_SPLIT = {
    "train": """dolphin seal aquarium_fish ray trout orchid sunflower tulip bottle bowl can cup
        plate apple mushroom orange pear clock keyboard chair couch bee caterpillar cockroach
        bear lion tiger wolf bridge castle house road skyscraper cloud forest mountain elephant
        kangaroo porcupine possum raccoon skunk lobster spider boy girl dinosaur lizard snake
        turtle hamster mouse rabbit shrew squirrel oak_tree palm_tree pine_tree willow_tree bus
        train lawn_mower streetcar tank""".split(),
    "val": """beaver otter flatfish shark lamp television beetle butterfly sea camel cattle crab
        crocodile maple_tree motorcycle tractor""".split(),
    "test": """whale poppy rose sweet_pepper telephone bed table wardrobe leopard plain chimpanzee
        fox snail worm baby man woman bicycle pickup_truck rocket""".split(),
}
# Oreshkin et al.'s FC100 split of CIFAR-100's super-classes (12 / 4 / 4).
FC100_SPLIT = {
    "train": """fish flowers food_containers fruit_and_vegetables household_electrical_devices
        household_furniture large_man-made_outdoor_things large_natural_outdoor_scenes reptiles
        trees vehicles_1 vehicles_2""".split(),
    "val": """large_carnivores large_omnivores_and_herbivores non-insect_invertebrates
        small_mammals""".split(),
    "test": "aquatic_mammals insects medium_mammals people".split(),
}


def pixels(
    height: int, width: int, channels: int = 3, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Random uint8 ``[height, width, channels]`` (from ``rng``, else the module's)."""
    return (RNG if rng is None else rng).integers(0, 256, size=(height, width, channels),
                                                  dtype=np.uint8)  # fmt: skip


def write_mini_csv(root: Path) -> Path:
    """Ravi and Larochelle's layout: images/ + {split}.csv, 2 JPEGs (84x84) per class."""
    (root / "images").mkdir(parents=True)
    wnid = 1000
    for split, classes in MINI.items():
        with open(root / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["filename", "label"])
            for _ in range(classes):
                wnid += 1
                for k in (2, 1):  # file order within a class is kept, not sorted
                    name = f"n{wnid:08d}{k:08d}.jpg"
                    Image.fromarray(pixels(84, 84)).save(root / "images" / name)
                    writer.writerow([name, f"n{wnid:08d}"])
    return root


def tiered_labels(split: str, per_class: int = 2) -> dict:
    """A ``{split}_labels.pkl`` of the published class and super-category counts."""
    classes, supers = TIERED[split]
    specific = [c for c in range(classes) for _ in range(per_class)]
    specific = [specific[i] for i in RNG.permutation(len(specific))]  # images not class-major
    return {
        "label_specific": specific,
        "label_general": [c % supers for c in specific],
        "label_specific_str": [f"n{split}{c:04d}" for c in range(classes)],
        "label_general_str": [f"super{s}" for s in range(supers)],
    }


def write_tiered(root: Path, forms: dict[str, str]) -> tuple[Path, dict]:
    """Ren et al.'s layout in ROOT/tiered-imagenet/, 84x84: each split of ``forms`` as PNG
    pickles (``"png"``) or npz (``"npz"``). Returns the root and the arrays written."""
    folder = root / "tiered-imagenet"
    folder.mkdir(parents=True)
    arrays = {}
    for split, form in forms.items():
        labels = tiered_labels(split)
        with open(folder / f"{split}_labels.pkl", "wb") as f:
            pickle.dump(labels, f)
        arrays[split] = np.stack([pixels(84, 84) for _ in labels["label_specific"]])
        if form == "npz":
            np.savez(folder / f"{split}_images.npz", images=arrays[split])
            continue
        encoded = []
        for image in arrays[split]:
            buffer = io.BytesIO()
            Image.fromarray(image).save(buffer, format="PNG")
            encoded.append(np.frombuffer(buffer.getvalue(), dtype=np.uint8))  # as cv2 writes
        with open(folder / f"{split}_images_png.pkl", "wb") as f:
            pickle.dump(encoded, f)
    return root, arrays


def write_cifar(root: Path, drop: str | None = None, rename: str | None = None) -> Path:
    """cifar-100-python/{train,test,meta}: 2 train and 1 test image per class."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    coarse_of = {f: COARSE.index(c) for f, c in SUPERCLASS.items()}
    for part, per_class in (("train", 2), ("test", 1)):
        fine = [i for i in range(100) for _ in range(per_class) if FINE[i] != drop]
        fine = [fine[i] for i in RNG.permutation(len(fine))]
        batch = {
            b"data": RNG.integers(0, 256, size=(len(fine), 3072), dtype=np.uint8),
            b"fine_labels": fine,
            b"coarse_labels": [coarse_of[FINE[i]] for i in fine],
        }
        with open(folder / part, "wb") as f:
            pickle.dump(batch, f)
    names = [("renamed" if n == rename else n).encode() for n in FINE]
    with open(folder / "meta", "wb") as f:
        pickle.dump(
            {b"fine_label_names": names, b"coarse_label_names": [c.encode() for c in COARSE]}, f
        )
    return root


def write_cub(root: Path, folder: str = "CUB_200_2011") -> Path:
    """``folder``/images/<NNN.Name>/*.jpg: 200 species, 2 or 3 photos of 20x14 each."""
    for i in range(1, 201):
        folder_i = root / folder / "images" / f"{i:03d}.Bird_{i}"
        folder_i.mkdir(parents=True)
        for k in range(2 + i % 2):
            Image.fromarray(pixels(14, 20)).save(folder_i / f"Bird_{i}_{k}.jpg")
    return root


def write_folder(root: Path) -> Path:
    """ROOT/{train,val,test}/<class>/: classes of 3, 5 and 4 grayscale PNGs of 12x12, the same
    pixels every call (a test's numbers must not depend on which tests ran before it)."""
    rng = np.random.default_rng(0)
    for split in ("train", "val", "test"):
        for name, count in (("cat", 3), ("dog", 5), ("emu", 4)):
            (root / split / name).mkdir(parents=True)
            for k in range(count):
                Image.fromarray(pixels(12, 12, 1, rng)[..., 0]).save(
                    root / split / name / f"{k}.png"
                )
    return root


# ---------------------------------------------------------------- arrays in every layout


def mini_classes(split: str) -> dict[str, np.ndarray]:
    """The fixture's mini-ImageNet split as arrays: wnid -> uint8 ``[n, 84, 84, 3]``, with
    2 or 3 images a class (classes uneven), the same for a split every call."""
    rng = np.random.default_rng(("train", "val", "test").index(split))
    first = {"train": 0, "val": 64, "test": 80}[split]
    return {
        f"n{9000 + first + c:08d}": rng.integers(0, 256, (2 + c % 2, 84, 84, 3), dtype=np.uint8)
        for c in range(MINI[split])
    }


def _shuffled(classes: dict[str, np.ndarray], seed: int) -> tuple[np.ndarray, list[str]]:
    """All images with the classes interleaved at random, each class's images in their
    order; and each row's class."""
    owners = [name for name, images in classes.items() for _ in images]
    owners = [owners[i] for i in np.random.default_rng(seed).permutation(len(owners))]
    taken = dict.fromkeys(classes, 0)
    rows = []
    for name in owners:
        rows.append(classes[name][taken[name]])
        taken[name] += 1
    return np.stack(rows), owners


def write_mini_cache(root: Path, validation: str = "val") -> Path:
    """Ren et al.'s pickles (``validation="val"``, as torchmeta downloads them) or
    learn2learn's (``"validation"``): image_data in a random order, class_dict its rows."""
    root.mkdir(parents=True, exist_ok=True)
    for split, file in (("train", "train"), ("val", validation), ("test", "test")):
        data, owners = _shuffled(mini_classes(split), seed=1)
        class_dict = {}
        for row, name in enumerate(owners):
            class_dict.setdefault(name, []).append(row)
        with open(root / f"mini-imagenet-cache-{file}.pkl", "wb") as f:
            pickle.dump({"image_data": data, "class_dict": class_dict}, f, protocol=4)
    return root


def write_mini_metaoptnet(root: Path) -> Path:
    """MetaOptNet's (Gidaris and Komodakis's) Python 2 pickles: data, labels (100 labels
    across the splits) and catname2label."""
    root.mkdir(parents=True, exist_ok=True)
    parts = {"train": "train_phase_train", "val": "val", "test": "test"}
    for split, part in parts.items():
        classes = mini_classes(split)
        first = {"train": 0, "val": 64, "test": 80}[split]
        catname2label = {name: first + c for c, name in enumerate(classes)}
        data, owners = _shuffled(classes, seed=2)
        archive = {
            "data": data,
            "labels": [catname2label[name] for name in owners],
            "catname2label": catname2label,
            "label2catname": list(classes),
        }
        (root / f"miniImageNet_category_split_{part}.pickle").write_bytes(py2_dumps(archive))
    return root


def write_mini_torchmeta(root: Path) -> Path:
    """torchmeta's conversion: miniimagenet/{split}_data.hdf5 (datasets/<wnid>) and
    {split}_labels.json, as torchmeta's MiniImagenet.download writes them."""
    import h5py

    folder = root / "miniimagenet"
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val", "test"):
        classes = mini_classes(split)
        with h5py.File(folder / f"{split}_data.hdf5", "w") as f:
            group = f.create_group("datasets")
            for name in reversed(list(classes)):  # any order in the file
                group.create_dataset(name, data=classes[name])
        (folder / f"{split}_labels.json").write_text(json.dumps(sorted(classes)))
    return root


def write_tiered_torchmeta(ren: Path, root: Path, split: str) -> Path:
    """torchmeta's conversion of a Ren et al. split (from `write_tiered`), as its
    TieredImagenet.download writes it: tieredimagenet/{split}_data.hdf5, one dataset of
    PNG bytes per class with its super-category, and {split}_labels.json."""
    import h5py

    folder = root / "tieredimagenet"
    folder.mkdir(parents=True, exist_ok=True)
    with open(ren / "tiered-imagenet" / f"{split}_labels.pkl", "rb") as f:
        labels = pickle.load(f)  # the fixture's own file
    with open(ren / "tiered-imagenet" / f"{split}_images_png.pkl", "rb") as f:
        images = pickle.load(f)
    specific = np.asarray(labels["label_specific"])
    (folder / f"{split}_labels.json").write_text(json.dumps(labels["label_specific_str"]))
    with h5py.File(folder / f"{split}_data.hdf5", "w") as f:
        group = f.create_group("datasets")
        for i, name in enumerate(labels["label_specific_str"]):
            (indices,) = np.nonzero(specific == i)
            dataset = group.create_dataset(
                name, (len(indices),), dtype=h5py.special_dtype(vlen=np.uint8)
            )
            general = labels["label_general"][indices[0]]
            dataset.attrs["label_general"] = labels["label_general_str"][general]
            dataset.attrs["label_specific"] = name
            for j, k in enumerate(indices):
                dataset[j] = np.squeeze(images[k])
    return root


def write_cifar_torchmeta(cifar: Path, root: Path) -> Path:
    """torchmeta's conversion of CIFAR-100 (from `write_cifar`): cifar100/data.hdf5, a
    group per super-class and a dataset per class (train images, then test), with
    cifar100/cifar-fs/ and cifar100/fc100/{split}_labels.json ([super-class, class] pairs)."""
    import h5py

    folder = root / "cifar100"
    folder.mkdir(parents=True, exist_ok=True)
    images, fine = [], []
    for part in ("train", "test"):
        with open(cifar / "cifar-100-python" / part, "rb") as f:
            batch = pickle.load(f)  # the fixture's own file
        images.append(np.asarray(batch[b"data"]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        fine.append(np.asarray(batch[b"fine_labels"]))
    images, fine = np.concatenate(images), np.concatenate(fine)
    with h5py.File(folder / "data.hdf5", "w") as f:
        for coarse in COARSE:
            group = f.create_group(coarse)
            for j in sorted(FINE.index(c) for c in FINE if SUPERCLASS[c] == coarse):
                group.create_dataset(FINE[j], data=images[fine == j])
    for name, split_classes in (
        ("cifar-fs", CIFAR_FS_SPLIT),
        ("fc100", {s: [c for c in FINE if SUPERCLASS[c] in cs] for s, cs in FC100_SPLIT.items()}),
    ):
        (folder / name).mkdir()
        for split, classes in split_classes.items():
            pairs = [[SUPERCLASS[c], c] for c in classes]
            (folder / name / f"{split}_labels.json").write_text(json.dumps(pairs))
    return root
