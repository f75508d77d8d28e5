"""Writers of each image benchmark in its published layout, tiny: for the loader tests and
the experiment's end-to-end runs.

Each writer puts the published number of classes per split on disk with two or three
small random images each, in the files and folders the real release has.
"""

from __future__ import annotations

import csv
import io
import pickle
from pathlib import Path

import numpy as np
from PIL import Image

from metalearn.data.cifar import CIFAR100_SUPERCLASSES

RNG = np.random.default_rng(0)
MINI = {"train": 64, "val": 16, "test": 20}
TIERED = {"train": (351, 20), "val": (97, 6), "test": (160, 8)}
FINE = sorted(c for classes in CIFAR100_SUPERCLASSES.values() for c in classes)
COARSE = sorted(CIFAR100_SUPERCLASSES)


def pixels(height: int, width: int, channels: int = 3) -> np.ndarray:
    """Random uint8 ``[height, width, channels]``."""
    return RNG.integers(0, 256, size=(height, width, channels), dtype=np.uint8)


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
    coarse_of = {f: COARSE.index(c) for c, fs in CIFAR100_SUPERCLASSES.items() for f in fs}
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


def write_cub(root: Path) -> Path:
    """CUB_200_2011/images/<NNN.Name>/*.jpg: 200 species, 2 or 3 photos of 20x14 each."""
    for i in range(1, 201):
        folder = root / "CUB_200_2011" / "images" / f"{i:03d}.Bird_{i}"
        folder.mkdir(parents=True)
        for k in range(2 + i % 2):
            Image.fromarray(pixels(14, 20)).save(folder / f"Bird_{i}_{k}.jpg")
    return root


def write_folder(root: Path) -> Path:
    """ROOT/{train,val,test}/<class>/: classes of 3, 5 and 4 grayscale PNGs of 12x12."""
    for split in ("train", "val", "test"):
        for name, count in (("cat", 3), ("dog", 5), ("emu", 4)):
            (root / split / name).mkdir(parents=True)
            for k in range(count):
                Image.fromarray(pixels(12, 12, 1)[..., 0]).save(root / split / name / f"{k}.png")
    return root
