"""Data: Omniglot layout, cache, splits and download safety; episodic and sine sampling.

The full-data tests read the real Omniglot where the tools find it (conftest.py, ``OMNIGLOT``)
beside the checkout, decoding it once per session (about 5-7 s on two cores) into a cache
under pytest's tmp dir. Everything else runs on a tiny tree of PNGs built here.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from metalearn.data import (
    OMNIGLOT_ZIPS,
    EpisodicSampler,
    SineTasks,
    ZipSource,
    ensure_omniglot,
    load_omniglot,
    omniglot_samplers,
    omniglot_splits,
    resolve_data_root,
    safe_extract,
)
from metalearn.data import omniglot as om
from metalearn.engine import InnerLoop, Task, TaskCall, task_loss
from metalearn.models import MLP, Conv4
from tests.conftest import HAS_OMNIGLOT, NO_OMNIGLOT, OMNIGLOT

SIDE = 105  # Omniglot drawings are 105x105


REAL_ROOT = OMNIGLOT if HAS_OMNIGLOT else None
needs_real = pytest.mark.skipif(REAL_ROOT is None, reason=NO_OMNIGLOT)


# ---------------------------------------------------------------- a tiny Omniglot tree


def _drawing(seed: int) -> Image.Image:
    """A 1-bit 105x105 drawing like Omniglot's: white background, one black rectangle."""
    rng = np.random.default_rng(seed)
    pixels = np.ones((SIDE, SIDE), dtype=bool)
    top, left = rng.integers(0, SIDE - 30, size=2)
    pixels[top : top + 30, left : left + 12] = False
    return Image.fromarray(pixels)  # mode "1"


TINY = {
    "images_background": {"Alpha": 2, "Beta": 2, "Gamma": 1},
    "images_evaluation": {"Delta": 2},
}
TINY_DRAWINGS = 4


def _make_tree(root: Path, drawings: int = TINY_DRAWINGS) -> Path:
    seed = 0
    for subset, alphabets in TINY.items():
        for alphabet, characters in alphabets.items():
            for c in range(1, characters + 1):
                folder = root / subset / alphabet / f"character{c:02d}"
                folder.mkdir(parents=True)
                for d in range(1, drawings + 1):
                    _drawing(seed).save(folder / f"{seed:04d}_{d:02d}.png")
                    seed += 1
    return root


@pytest.fixture
def tiny(tmp_path) -> Path:
    return _make_tree(tmp_path / "omniglot")


def _load(root, cache, **kwargs):
    return load_omniglot(root, cache_dir=cache, progress=False, download=False, **kwargs)


def test_tiny_tree_loads_in_sorted_order_with_ink_as_one(tiny, tmp_path):
    data = _load(tiny, tmp_path / "cache")
    assert data.images.shape == (7, TINY_DRAWINGS, 28, 28) and data.images.dtype == torch.uint8
    assert data.characters[:2] == ("Alpha/character01", "Alpha/character02")
    assert data.characters[-1] == "Delta/character02"
    assert data.background.tolist() == [True] * 5 + [False] * 2
    # Reference: PIL on the file itself, inverted (strokes 1) as in MAML's generator.
    path = sorted((tiny / "images_evaluation/Delta/character02").glob("*.png"))[3]
    with Image.open(path) as image:
        ref = 255 - np.asarray(image.convert("L").resize((28, 28), Image.Resampling.LANCZOS))
    assert np.array_equal(data.images[6, 3].numpy(), ref)
    x = data.to_float(torch.tensor([6]), dtype=torch.float64)
    assert x.shape == (1, TINY_DRAWINGS, 1, 28, 28) and x.dtype == torch.float64
    assert 0 <= x.min() and x.max() <= 1 and x.mean() < 0.2  # mostly background (0)


def test_nearest_reproduces_mamls_resize_script(tiny, tmp_path):
    # MAML's resize_images.py: Image.open(f).resize((28, 28), resample=Image.LANCZOS) on
    # the 1-bit PNG (Pillow then uses NEAREST), later read as 1 - png / 255.
    data = _load(tiny, tmp_path / "cache", resample="nearest")
    path = sorted((tiny / "images_background/Beta/character01").glob("*.png"))[0]
    with Image.open(path) as image:
        maml = np.asarray(image.resize((28, 28), resample=Image.Resampling.LANCZOS))
    assert set(np.unique(data.images[2, 0].numpy())) <= {0, 255}
    assert np.array_equal(data.images[2, 0].numpy(), 255 * (1 - maml.astype(np.uint8)))


def test_cache_hit_miss_and_invalidation(tiny, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = _load(tiny, cache)
    files = sorted(cache.glob("*.pt"))
    assert len(files) == 1 and not list(cache.glob(".*"))  # atomic: no temp file left

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded although the cache should have hit")

    with monkeypatch.context() as patch:
        patch.setattr(om, "decode_many", no_decoding)
        hit = _load(tiny, cache)
    assert torch.equal(hit.images, first.images) and hit.characters == first.characters

    # A changed drawing (new content, new mtime) changes the key: a miss, new pixels.
    path = sorted((tiny / "images_background/Alpha/character01").glob("*.png"))[0]
    Image.fromarray(np.zeros((SIDE, SIDE), dtype=bool)).save(path)  # all ink
    os.utime(path, ns=(1, 1))
    changed = _load(tiny, cache)
    assert len(list(cache.glob("*.pt"))) == 2
    assert (changed.images[0, 0] == 255).all() and not (first.images[0, 0] == 255).all()
    assert torch.equal(changed.images[1:], first.images[1:])
    assert changed.fingerprint != first.fingerprint
    assert len({p.name for p in cache.glob("*.pt")} - {p.name for p in files}) == 1


def test_unreadable_cache_is_rebuilt_with_a_warning(tiny, tmp_path):
    cache = tmp_path / "cache"
    first = _load(tiny, cache)
    (path,) = cache.glob("*.pt")
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.warns(UserWarning, match="unreadable Omniglot cache"):
        again = _load(tiny, cache)
    assert torch.equal(again.images, first.images)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [(lambda c: c.update(images=c["images"][:-1]),
      "its images are uint8 [6, 4, 28, 28], where the files decode to uint8 [7, 4, 28, 28]"),
     (lambda c: c.update(images=c["images"].float()),
      "its images are float32 [7, 4, 28, 28], where the files decode to uint8 [7, 4, 28, 28]"),
     (lambda c: c.pop("images"),
      "its images are missing, where the files decode to uint8 [7, 4, 28, 28]"),
     (lambda c: c.update(characters=c["characters"][::-1]),
      "its characters or alphabets are not the folder's"),
     (lambda c: c.update(background=c["background"][:3]),
      "its background flags are bool [3], not the folder's bool [7]")],
)  # fmt: skip
def test_a_cache_whose_fingerprint_matches_but_whose_arrays_do_not_is_rebuilt(
    tiny, tmp_path, edit, problem
):
    """The fingerprint is of the files' names, sizes and times, not of the cache's contents:
    a cache file edited or written by other code is refused in one line and rebuilt, never
    read as the data (a class short, or the wrong alphabets)."""
    cache = tmp_path / "cache"
    first = _load(tiny, cache)
    (path,) = cache.glob("*.pt")
    contents = torch.load(path, weights_only=True)
    edit(contents)
    torch.save(contents, path)  # the same fingerprint inside
    with pytest.warns(UserWarning) as caught:
        again = _load(tiny, cache)
    (warning,) = [str(w.message) for w in caught if "Omniglot cache" in str(w.message)]
    assert warning == (f"ignoring the Omniglot cache {path}: its fingerprint matches the files "
                       f"but {problem}; rebuilding it")  # fmt: skip
    assert torch.equal(again.images, first.images) and again.characters == first.characters
    assert torch.equal(again.background, first.background)
    rebuilt = torch.load(path, weights_only=True)  # the rebuilt cache replaced the edited one
    assert torch.equal(rebuilt["images"], first.images) and not list(cache.glob(".*"))


def test_cache_dir_and_data_root_from_environment(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("METALEARN_DATA", str(tiny.parent))  # a folder holding omniglot/
    monkeypatch.setenv("METALEARN_CACHE", str(tmp_path / "env-cache"))
    assert resolve_data_root() == tiny.parent
    assert resolve_data_root(tiny) == tiny  # an explicit root wins
    data = load_omniglot(progress=False, download=False)
    assert len(data.characters) == 7 and len(list((tmp_path / "env-cache").glob("*.pt"))) == 1


def test_an_unwritable_cache_runs_uncached_with_a_warning(tiny, tmp_path):
    reference = _load(tiny, tmp_path / "cache")
    (tmp_path / "a-file").write_text("")  # the cache folder's parent is a file: even root
    cache = tmp_path / "a-file" / "cache"  # cannot create it
    with pytest.warns(UserWarning, match=rf"could not write the Omniglot cache {cache}/omniglot-"
                      r"28px.*: Not a directory; .*; running uncached"):  # fmt: skip
        data = _load(tiny, cache)
    assert torch.equal(data.images, reference.images) and data.characters == reference.characters


@pytest.mark.skipif(os.name != "posix", reason="file-size limits are POSIX")
def test_a_full_disk_runs_uncached_with_a_warning(tiny, tmp_path):
    import resource

    reference = _load(tiny, tmp_path / "cache", image_size=64)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # Writes past 16 KiB fail as on a full disk (EFBIG; Python ignores SIGXFSZ); the cache
    # holds 7 x 4 x 64 x 64 bytes = 115 KB.
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, hard))
    try:
        with pytest.warns(UserWarning, match=r"could not write the Omniglot cache .*: File too "
                          r"large; .*running uncached"):  # fmt: skip
            data = _load(tiny, tmp_path / "full", image_size=64)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert torch.equal(data.images, reference.images)
    assert list((tmp_path / "full").iterdir()) == []  # no partial cache file left behind


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_drawing_is_named(tiny, tmp_path, workers):
    bad = tiny / "images_background/Beta/character02/0012_01.png"
    assert bad.exists()
    bad.write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"cannot decode .*Beta/character02/0012_01\.png"):
        _load(tiny, tmp_path / "cache", workers=workers)


def test_decoding_in_a_pool_equals_decoding_here(tiny, tmp_path):
    here = _load(tiny, tmp_path / "a", workers=0)
    pool = _load(tiny, tmp_path / "b", workers=2)
    assert torch.equal(here.images, pool.images)


def test_uneven_characters_are_refused(tiny, tmp_path):
    (tiny / "images_background/Gamma/character01/0016_01.png").unlink()
    with pytest.raises(ValueError, match="different numbers of drawings"):
        _load(tiny, tmp_path / "cache")


# ---------------------------------------------------------------- missing data, download


def test_missing_root_says_how_to_get_the_data(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        ensure_omniglot(tmp_path / "nowhere", download=False)
    message = str(info.value)
    for needle in ("METALEARN_DATA", "--data-root", *(s.url for s in OMNIGLOT_ZIPS.values())):
        assert needle in message


def test_failed_download_raises_file_not_found(tmp_path):
    gone = {s: ZipSource((tmp_path / f"{s}.zip").as_uri(), None) for s in om.SUBSETS}
    with pytest.raises(FileNotFoundError, match="Downloading file:.*failed.*METALEARN_DATA"):
        ensure_omniglot(tmp_path / "empty", sources=gone)


def test_nonempty_foreign_root_is_not_downloaded_into(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match=r"not empty \(notes\.txt\)"):
        ensure_omniglot(tmp_path / "mine")


def _zip_subsets(tree: Path, out: Path) -> dict[str, ZipSource]:
    sources = {}
    for subset in om.SUBSETS:
        path = out / f"{subset}.zip"
        with zipfile.ZipFile(path, "w") as archive:
            for file in sorted((tree / subset).rglob("*")):
                archive.write(file, file.relative_to(tree).as_posix())
        md5 = hashlib.md5(path.read_bytes()).hexdigest()
        sources[subset] = ZipSource(path.as_uri(), md5)
    return sources


def test_download_verifies_and_extracts_into_an_empty_root(tiny, tmp_path):
    sources = _zip_subsets(tiny, tmp_path)
    target = tmp_path / "downloaded"
    assert ensure_omniglot(target, sources=sources) == target
    assert sorted(p.name for p in target.iterdir()) == list(om.SUBSETS)  # no leftovers
    data = load_omniglot(target, cache_dir=tmp_path / "cache", progress=False, download=False)
    assert torch.equal(data.images, _load(tiny, tmp_path / "cache2").images)


def test_download_with_wrong_md5_is_refused(tiny, tmp_path):
    sources = _zip_subsets(tiny, tmp_path)
    sources["images_background"] = ZipSource(sources["images_background"].url, "0" * 32)
    target = tmp_path / "downloaded"
    with pytest.raises(ValueError, match="MD5 .* expected 0{32}"):
        ensure_omniglot(target, sources=sources)
    assert not (target / "images_background").exists()


@pytest.mark.parametrize("member", ["../evil", "/evil", "a/../../evil", "C:/evil"])
def test_safe_extract_rejects_escaping_members(tmp_path, member):
    path = tmp_path / "bad.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("fine.txt", "ok")
        archive.writestr(zipfile.ZipInfo(member), "gotcha")
    target = tmp_path / "out" / "deep"
    with pytest.raises(ValueError, match="refusing to extract.*outside the target"):
        safe_extract(path, target)
    assert not target.exists() and not (tmp_path / "out" / "evil").exists()


def test_safe_extract_rejects_symlinks_and_corrupt_members(tmp_path):
    link = zipfile.ZipInfo("link")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    with zipfile.ZipFile(tmp_path / "link.zip", "w") as archive:
        archive.writestr(link, "/etc/passwd")
    with pytest.raises(ValueError, match="symbolic link"):
        safe_extract(tmp_path / "link.zip", tmp_path / "out")

    payload = b"omniglot" * 64
    with zipfile.ZipFile(tmp_path / "crc.zip", "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("data.bin", payload)
    raw = bytearray((tmp_path / "crc.zip").read_bytes())
    at = raw.index(payload)
    raw[at] ^= 0xFF
    (tmp_path / "crc.zip").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="'data.bin' fails its CRC check"):
        safe_extract(tmp_path / "crc.zip", tmp_path / "out2")


# ---------------------------------------------------------------- the real Omniglot


@pytest.fixture(scope="session")
def omniglot():
    if REAL_ROOT is None:
        pytest.skip(NO_OMNIGLOT)
    # The session's $METALEARN_CACHE (conftest.py): decoded once, shared with other tests.
    return load_omniglot(REAL_ROOT, progress=False, download=False)


@needs_real
def test_real_omniglot_counts(omniglot):
    assert len(list(REAL_ROOT.glob("images_*/*/*/*.png"))) == 32460
    assert omniglot.images.shape == (1623, 20, 28, 28)
    assert int(omniglot.background.sum()) == 964 and int((~omniglot.background).sum()) == 659
    background = {a for a, b in zip(omniglot.alphabets, omniglot.background.tolist()) if b}
    assert len(background) == 30 and len(set(omniglot.alphabets) - background) == 20
    assert len(set(omniglot.characters)) == 1623


@needs_real
def test_real_images_match_their_files(omniglot):
    for index in (0, 777, 1622):
        alphabet, character = omniglot.characters[index].split("/")
        subset = "images_background" if omniglot.background[index] else "images_evaluation"
        last = sorted((REAL_ROOT / subset / alphabet / character).glob("*.png"))[-1]
        with Image.open(last) as image:
            ref = 255 - np.asarray(image.convert("L").resize((28, 28), Image.Resampling.LANCZOS))
        assert np.array_equal(omniglot.images[index, -1].numpy(), ref)
    ink = omniglot.images.float().mean() / 255
    assert 0.03 < ink < 0.3  # strokes are 1 and sparse


@needs_real
def test_maml_split_sizes_disjoint_and_seeded(omniglot):
    splits = omniglot_splits(omniglot, "maml")
    assert [len(splits[k]) for k in ("train", "val", "test")] == [1100, 100, 423]
    union = torch.cat(list(splits.values()))
    assert len(union) == len(set(union.tolist())) == 1623
    again = omniglot_splits(omniglot, "maml")
    assert all(torch.equal(splits[k], again[k]) for k in splits)
    assert not torch.equal(splits["test"], omniglot_splits(omniglot, "maml", seed=2)["test"])
    samplers = omniglot_samplers(omniglot, "maml", ways=5, shots=1, queries=15)
    assert {k: s.num_classes for k, s in samplers.items()} == {
        "train": 4400,
        "val": 400,
        "test": 1692,
    }


@needs_real
@pytest.mark.parametrize("split", ["maml", "alphabet"])
def test_trainval_trains_on_the_training_and_validation_characters(omniglot, split):
    """``trainval``: the training set is the training and validation characters (their
    sorted union), no validation set, the test set untouched; on MAML's split 1,200
    characters, 4,800 classes with rotations, as the Prototypical Networks reference's
    ``data/omniglot/splits/vinyals/trainval.txt`` lists (its ``test.txt``: 1,692, here 423
    characters times four rotations)."""
    apart = omniglot_splits(omniglot, split)
    joined = omniglot_splits(omniglot, split, trainval=True)
    union = sorted(apart["train"].tolist() + apart["val"].tolist())
    assert joined["train"].tolist() == union and len(joined["val"]) == 0
    assert torch.equal(joined["test"], apart["test"])
    samplers = omniglot_samplers(omniglot, split, ways=5, shots=1, queries=15, trainval=True)
    assert "val" not in samplers
    if split == "maml":
        assert (samplers["train"].num_classes, samplers["test"].num_classes) == (4800, 1692)
    # the validation characters' classes (with their rotations) join the training ones
    train = omniglot_samplers(omniglot, split, ways=5, shots=1, queries=15)["train"]
    assert samplers["train"].num_classes == train.num_classes + (
        len(apart["val"]) * len(train.rotations))  # fmt: skip


@needs_real
def test_alphabet_split_follows_the_subsets(omniglot):
    splits = omniglot_splits(omniglot, "alphabet")
    background = set(torch.nonzero(omniglot.background).flatten().tolist())
    assert set(splits["train"].tolist()) | set(splits["val"].tolist()) == background
    assert len(splits["test"]) == 659 and not set(splits["test"].tolist()) & background
    alphabets = {k: {omniglot.alphabets[i] for i in v.tolist()} for k, v in splits.items()}
    assert len(alphabets["val"]) == 5 and not alphabets["val"] & alphabets["train"]
    none = omniglot_splits(omniglot, "alphabet", val_alphabets=0)
    assert len(none["val"]) == 0 and len(none["train"]) == 964
    samplers = omniglot_samplers(omniglot, "alphabet", ways=20, shots=5, queries=15)
    assert samplers["test"].num_classes == 659 and samplers["test"].rotations == (0,)
    with pytest.raises(ValueError, match="split='vinyals'; choose one of"):
        omniglot_splits(omniglot, "vinyals")


@needs_real
def test_real_tasks_have_the_right_shapes_and_train(omniglot):
    sampler = omniglot_samplers(omniglot, "maml", ways=5, shots=1, queries=15)["train"]
    task = sampler.sample(torch.Generator().manual_seed(0))
    assert task.support[0].shape == (5, 1, 28, 28) and task.query[0].shape == (75, 1, 28, 28)
    model = Conv4(ways=5, hidden=8)
    result = task_loss(model, dict(model.named_parameters()), TaskCall.of(task, InnerLoop()))
    assert torch.isfinite(result.loss)


# ---------------------------------------------------------------- the episodic sampler


def _distinct_images(classes=6, examples=7, side=5) -> torch.Tensor:
    return torch.randn(
        classes,
        examples,
        1,
        side,
        side,
        generator=torch.Generator().manual_seed(3),
        dtype=torch.float64,
    )


@pytest.mark.parametrize("rotations", [(0,), (0, 1, 2, 3), (2, 3)])
def test_sampler_tasks_equal_indexing_and_rot90(rotations):
    images = _distinct_images()
    sampler = EpisodicSampler(images, ways=4, shots=2, queries=3, rotations=rotations)
    classes, examples = sampler.sample_indices(torch.Generator().manual_seed(0), tasks=6)
    tasks = sampler.batch(6, torch.Generator().manual_seed(0))
    assert classes.shape == (6, 4) and examples.shape == (6, 4, 5) and len(tasks) == 6
    for task, task_classes, task_examples in zip(tasks, classes, examples):
        assert len(set(task_classes.tolist())) == 4 and int(task_classes.max()) < 6 * len(rotations)
        for j, (c, row) in enumerate(zip(task_classes.tolist(), task_examples)):
            assert len(set(row.tolist())) == 5  # support and query never share a drawing
            character, turns = divmod(c, len(rotations))
            ref = torch.rot90(images[character, row], rotations[turns], dims=(-2, -1))
            assert torch.equal(task.support[0][2 * j : 2 * j + 2], ref[:2])
            assert torch.equal(task.query[0][3 * j : 3 * j + 3], ref[2:])
        assert task.support[1].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert task.query[1].tolist() == [j for j in range(4) for _ in range(3)]
        assert task.support[1].dtype == torch.long and task.support[0].dtype == torch.float64


def test_uint8_images_come_out_scaled_like_to_float(tiny, tmp_path):
    data = _load(tiny, tmp_path / "cache")
    sampler = EpisodicSampler(
        data.images.unsqueeze(2), ways=3, shots=2, queries=2, rotations=(0, 1)
    )
    classes, examples = sampler.sample_indices(torch.Generator().manual_seed(1))
    task = sampler.sample(torch.Generator().manual_seed(1))
    floats = data.to_float()  # the reference: [C, M, 1, 28, 28] float32 in [0, 1]
    assert task.support[0].dtype == torch.float32
    for j, c in enumerate(classes[0].tolist()):
        ref = torch.rot90(floats[c // 2, examples[0, j]], c % 2, dims=(-2, -1))
        assert torch.equal(task.support[0][2 * j : 2 * j + 2], ref[:2])
        assert torch.equal(task.query[0][2 * j : 2 * j + 2], ref[2:])


@pytest.mark.parametrize("ways", [3, 5])  # 3 * 3 <= 12: rejection path; 5 * 5 > 12: topk
def test_sampler_draws_every_class_and_example_evenly(ways):
    # `ways` of 12 classes and 4 of 7 examples over 4000 tasks: a class is drawn w.p. ways/12,
    # an example w.p. 4/7, a class gets label 0 w.p. 1/12. The bounds are > 5 binomial
    # standard deviations (at most 31, 54 and 17.5 counts).
    sampler = EpisodicSampler(_distinct_images(), ways=ways, shots=1, queries=3, rotations=(0, 1))
    classes, examples = sampler.sample_indices(torch.Generator().manual_seed(0), tasks=4000)
    assert not any(len(set(row)) < ways for row in classes.tolist())
    assert not any(len(set(row)) < 4 for row in examples.flatten(0, 1).tolist())
    class_counts = torch.bincount(classes.flatten(), minlength=12)
    assert (class_counts - 4000 * ways / 12).abs().max() < 160, class_counts
    example_counts = torch.bincount(examples.flatten(), minlength=7)
    assert (example_counts - 4000 * ways * 4 / 7).abs().max() < 5 * 54 * math.sqrt(ways / 3)
    first_label = torch.bincount(classes[:, 0], minlength=12)  # label order is random too
    assert (first_label - 4000 / 12).abs().max() < 90, first_label


def test_sampler_is_reproducible():
    sampler = EpisodicSampler(_distinct_images(), ways=3, shots=1, queries=2, rotations=(0, 1))
    one = sampler.batch(4, torch.Generator().manual_seed(7))
    two = sampler.batch(4, torch.Generator().manual_seed(7))
    other = sampler.batch(4, torch.Generator().manual_seed(8))
    flat = lambda tasks: torch.cat([torch.cat([t.support[0], t.query[0]]) for t in tasks])  # noqa: E731
    assert torch.equal(flat(one), flat(two)) and not torch.equal(flat(one), flat(other))
    assert all(isinstance(t, Task) for t in one)
    single = sampler.sample(torch.Generator().manual_seed(7))
    assert torch.equal(
        single.query[0], sampler.batch(1, torch.Generator().manual_seed(7))[0].query[0]
    )


def test_sampler_errors_name_the_numbers():
    images = _distinct_images(classes=5, examples=20)
    with pytest.raises(
        ValueError,
        match=r"ways=21 but only 20 classes are available \(5 classes x 4 rotations\); lower ways$",
    ):
        EpisodicSampler(images, ways=21, shots=1, queries=1, rotations=(0, 1, 2, 3))
    with pytest.raises(ValueError, match=r"5 \+ 16 = 21 but each class has only 20 examples"):
        EpisodicSampler(images, ways=2, shots=5, queries=16)
    with pytest.raises(ValueError, match="distinct quarter turns"):
        EpisodicSampler(images, ways=2, shots=1, queries=1, rotations=(0, 4))
    with pytest.raises(ValueError, match=r"images must be \[classes, examples"):
        EpisodicSampler(images[:, :, 0], ways=2, shots=1, queries=1)
    sampler = EpisodicSampler(images, ways=2, shots=1, queries=1)
    with pytest.raises(ValueError, match="expected a torch.Generator, got int"):
        sampler.sample(0)


# ---------------------------------------------------------------- sine regression


def test_sine_tasks_follow_mamls_distribution():
    tasks = SineTasks(shots=5, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    functions = [tasks.sample_function(generator) for _ in range(200)]
    amplitudes, phases = zip(*functions)
    assert 0.1 <= min(amplitudes) and max(amplitudes) <= 5.0 and max(amplitudes) > 4.5
    assert 0.0 <= min(phases) and max(phases) <= math.pi and max(phases) > 2.8
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    amplitude, phase = tasks.sample_function(g1)
    task = tasks.sample(g2)
    assert task.support[0].shape == task.support[1].shape == (5, 1)
    assert task.query[0].shape == task.query[1].shape == (5, 1)
    for x, y in (task.support, task.query):
        assert x.abs().max() <= 5.0
        expected = [amplitude * math.sin(v - phase) for v in x.flatten().tolist()]
        assert torch.allclose(y.flatten(), torch.tensor(expected, dtype=torch.float64), atol=1e-12)


def test_sine_is_reproducible_and_trains_an_mlp():
    tasks = SineTasks(shots=10, queries=3)
    one = tasks.batch(3, torch.Generator().manual_seed(5))
    two = tasks.batch(3, torch.Generator().manual_seed(5))
    assert all(torch.equal(a.query[1], b.query[1]) for a, b in zip(one, two))
    assert one[0].query[0].shape == (3, 1) and one[0].support[1].dtype == torch.float32
    model = MLP(1, [40, 40], 1)
    inner = InnerLoop(lr=0.01, loss_fn=F.mse_loss)
    result = task_loss(model, dict(model.named_parameters()), TaskCall.of(one[0], inner))
    assert torch.isfinite(result.loss)
    with pytest.raises(ValueError, match="amplitude=.*low end"):
        SineTasks(amplitude=(5.0, 0.1))
    with pytest.raises(ValueError, match="expected a torch.Generator"):
        tasks.sample(None)


def test_decode_image_names_a_bad_filter_before_opening_the_file(tmp_path) -> None:
    from metalearn.data.omniglot import decode_image

    with pytest.raises(ValueError, match="resample must be one of"):
        decode_image(str(tmp_path / "missing.png"), 28, "cubic")
