"""Data: Omniglot (load, cache, split), episodic N-way K-shot sampling, image folders, sine.

Typical use::

    from metalearn.data import load_omniglot, omniglot_samplers

    data = load_omniglot(args.data_root)  # or $METALEARN_DATA; cached after the first call
    samplers = omniglot_samplers(data, "maml", ways=5, shots=1, queries=15)
    tasks = samplers["train"].batch(32, torch.Generator().manual_seed(0))
"""

from metalearn.data.folders import IMAGE_SUFFIXES, SupportSet, load_support_folder
from metalearn.data.omniglot import (
    OMNIGLOT_ZIPS,
    RESAMPLE_FILTERS,
    SPLIT_ROTATIONS,
    SPLITS,
    SUBSETS,
    OmniglotImages,
    ZipSource,
    decode_image,
    default_cache_dir,
    download_omniglot,
    ensure_omniglot,
    load_omniglot,
    omniglot_samplers,
    omniglot_splits,
    resolve_data_root,
    safe_extract,
)
from metalearn.data.sampler import EpisodicSampler, check_generator
from metalearn.data.sine import SineTasks, sine

__all__ = [
    "IMAGE_SUFFIXES",
    "OMNIGLOT_ZIPS",
    "RESAMPLE_FILTERS",
    "SPLITS",
    "SPLIT_ROTATIONS",
    "SUBSETS",
    "EpisodicSampler",
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
    "load_support_folder",
    "omniglot_samplers",
    "omniglot_splits",
    "resolve_data_root",
    "safe_extract",
    "sine",
]
