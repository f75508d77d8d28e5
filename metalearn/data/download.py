"""Downloading a data set's zips: fetched, checked against their MD5 and CRCs, extracted safely.

A zip from the network is untrusted: `safe_extract` refuses, before writing anything, a
member that could land outside the target folder (absolute paths, drive letters, ``..``,
symbolic links) and a member that fails its CRC. `download_folders` fetches each zip,
checks its MD5 when one is published, extracts it into a temporary folder inside the root
and moves the expected folder into place, so an interrupted download never leaves a
half-extracted folder that looks complete.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import stat
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["ZipSource", "download_folders", "fetch", "safe_extract"]


@dataclass(frozen=True)
class ZipSource:
    """Where one official zip lives and its expected MD5 (None: not checked)."""

    url: str
    md5: str | None


def download_folders(
    root: str | os.PathLike, sources: Mapping[str, ZipSource], *, how_to_get: str
) -> dict[str, str]:
    """Download, verify and safely extract one zip per folder into ``root``.

    Args:
        root: where the folders go (created if missing).
        sources: ``{folder: its zip}``; each zip must hold ``folder/`` at its top.
        how_to_get: appended to a failed download's message: where the data comes from
            and how to point at a copy instead.

    Returns:
        The SHA-256 of each downloaded zip, by folder (to record alongside a run).

    Raises:
        FileNotFoundError: a download failed (no network, a missing URL).
        ValueError: a zip fails its MD5 or CRC check, is unsafe, or lacks its folder.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    digests = {}
    for folder, source in sources.items():
        zip_path = root / f".{folder}.zip"
        digests[folder] = fetch(source, zip_path, how_to_get=how_to_get)
        with tempfile.TemporaryDirectory(dir=root, prefix=".extract-") as tmp:
            safe_extract(zip_path, tmp)
            if not (Path(tmp) / folder).is_dir():
                raise ValueError(f"{source.url} does not contain the folder {folder}/")
            os.replace(Path(tmp) / folder, root / folder)
        zip_path.unlink()
    return digests


def fetch(source: ZipSource, dest: Path, *, how_to_get: str) -> str:
    """Stream ``source.url`` to ``dest``, check its MD5, return its SHA-256.

    Raises:
        FileNotFoundError: the download failed (the message ends with ``how_to_get``).
        ValueError: the MD5 differs from the published one (nothing is left at ``dest``).
    """
    md5, sha256 = hashlib.md5(), hashlib.sha256()
    part = dest.with_suffix(".part")
    try:
        with urllib.request.urlopen(source.url, timeout=60) as response, open(part, "wb") as f:
            while chunk := response.read(1 << 20):
                md5.update(chunk)
                sha256.update(chunk)
                f.write(chunk)
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as err:
        part.unlink(missing_ok=True)
        raise FileNotFoundError(f"Downloading {source.url} failed ({err}). {how_to_get}") from err
    if source.md5 is not None and md5.hexdigest() != source.md5:
        part.unlink()
        raise ValueError(
            f"{source.url} has MD5 {md5.hexdigest()}, expected {source.md5}: the download is "
            "corrupt or the file changed upstream; retry, or download and unzip it by hand"
        )
    os.replace(part, dest)
    return sha256.hexdigest()


def safe_extract(zip_path: str | os.PathLike, target: str | os.PathLike) -> list[str]:
    """Extract a zip, refusing any member that could land outside ``target``.

    Rejects absolute paths, drive letters, ``..`` components and symbolic links before
    writing anything, and checks every member's CRC (``ZipFile.testzip``).

    Returns:
        The member names extracted.

    Raises:
        ValueError: an unsafe member (named) or a corrupt archive.
    """
    with zipfile.ZipFile(zip_path) as archive:
        names = archive.namelist()
        for info in archive.infolist():
            _check_member(info, zip_path)
        bad = archive.testzip()
        if bad is not None:
            raise ValueError(
                f"{zip_path} is corrupt: member {bad!r} fails its CRC check; delete it and "
                "download again"
            )
        archive.extractall(target)
    return names


def _check_member(info: zipfile.ZipInfo, zip_path: str | os.PathLike) -> None:
    name = info.filename.replace("\\", "/")
    parts = PurePosixPath(name).parts
    is_link = stat.S_ISLNK(info.external_attr >> 16)
    if name.startswith("/") or (parts and ":" in parts[0]) or ".." in parts or is_link:
        raise ValueError(
            f"refusing to extract {zip_path}: member {info.filename!r} is "
            f"{'a symbolic link' if is_link else 'a path outside the target folder'}; "
            "the archive is not the official zip it claims to be"
        )
