"""Data: Omniglot (load, cache, split), episodic N-way K-shot sampling, image folders, sine,
Markov-chain sequences.

Typical use::

    from metalearn.data import load_omniglot, omniglot_samplers

    data = load_omniglot(args.data_root)  # or $METALEARN_DATA; cached after the first call
    samplers = omniglot_samplers(data, "maml", ways=5, shots=1, queries=15)
    tasks = samplers["train"].batch(32, torch.Generator().manual_seed(0))
"""

from metalearn.data.augment import (
    AUGMENTATION_KINDS,
    ColorJitter,
    Compose,
    HorizontalFlip,
    PadCrop,
    RandomResizedCrop,
    SmallAffine,
    standard_augmentation,
)
from metalearn.data.benchmarks import (
    IMAGE_SET_NAMES,
    IMAGE_SETS,
    image_format,
    image_set_samplers,
    load_image_set,
)
from metalearn.data.cache import default_cache_dir
from metalearn.data.cifar import load_cifar_fs, load_fc100
from metalearn.data.cub import load_cub
from metalearn.data.decoding import (
    MAX_IMAGE_SIZE,
    OMNIGLOT_FORMAT,
    RESAMPLE_FILTERS,
    ImageFormat,
    decode_image,
)
from metalearn.data.download import ZipSource, safe_extract
from metalearn.data.folders import IMAGE_SUFFIXES, SupportSet, load_images, load_support_folder
from metalearn.data.image_folder import load_image_folder
from metalearn.data.image_set import IMAGE_SPLITS, ImageSet
from metalearn.data.interop import from_learn2learn, task_from_l2l_batch
from metalearn.data.mini_imagenet import load_mini_imagenet
from metalearn.data.omniglot import (
    OMNIGLOT_ZIPS,
    SPLIT_ROTATIONS,
    SPLITS,
    SUBSETS,
    OmniglotImages,
    download_omniglot,
    ensure_omniglot,
    load_omniglot,
    omniglot_samplers,
    omniglot_splits,
    resolve_data_root,
)
from metalearn.data.sampler import Augmentation, EpisodicSampler, check_generator
from metalearn.data.sequences import MarkovSequenceTasks
from metalearn.data.sine import SineTasks, sine
from metalearn.data.sizes import PublishedSizes, check_task_sizes, published_sizes
from metalearn.data.tiered_imagenet import load_tiered_imagenet

__all__ = [
    "AUGMENTATION_KINDS",
    "ColorJitter",
    "Compose",
    "HorizontalFlip",
    "PadCrop",
    "RandomResizedCrop",
    "SmallAffine",
    "standard_augmentation",
    "IMAGE_SET_NAMES",
    "IMAGE_SETS",
    "image_format",
    "image_set_samplers",
    "load_image_set",
    "load_cifar_fs",
    "load_fc100",
    "load_cub",
    "load_image_folder",
    "IMAGE_SPLITS",
    "ImageSet",
    "from_learn2learn",
    "task_from_l2l_batch",
    "load_mini_imagenet",
    "Augmentation",
    "load_tiered_imagenet",
    "IMAGE_SUFFIXES",
    "ImageFormat",
    "MAX_IMAGE_SIZE",
    "OMNIGLOT_FORMAT",
    "OMNIGLOT_ZIPS",
    "RESAMPLE_FILTERS",
    "SPLITS",
    "SPLIT_ROTATIONS",
    "SUBSETS",
    "EpisodicSampler",
    "MarkovSequenceTasks",
    "OmniglotImages",
    "SineTasks",
    "SupportSet",
    "ZipSource",
    "check_generator",
    "decode_image",
    "default_cache_dir",
    "download_omniglot",
    "ensure_omniglot",
    "load_omniglot",
    "load_images",
    "load_support_folder",
    "omniglot_samplers",
    "omniglot_splits",
    "resolve_data_root",
    "safe_extract",
    "sine",
    "PublishedSizes",
    "check_task_sizes",
    "published_sizes",
]
