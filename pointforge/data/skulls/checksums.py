"""Check a downloaded dataset against the published sha256 list that ships with pointforge.

``skullfix.sha256`` (beside this module, in ``sha256sum`` format) lists the SkullFix
training set's files that pointforge's recipes read (skulls 000-079). :func:`verify`
reports each listed file as ok, missing or changed, so a user knows their copy is the
one the recipe's numbers were measured on.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from pointforge.errors import DataError

KNOWN = {"skullfix": "skullfix.sha256"}


def known_checksums(name: str = "skullfix") -> dict[str, str]:
    """Relative path → sha256 of a dataset pointforge knows (:data:`KNOWN`)."""
    if name not in KNOWN:
        raise DataError(f"no checksum list for {name!r}; known datasets: {', '.join(KNOWN)}")
    text = resources.files("pointforge.data.skulls").joinpath(KNOWN[name]).read_text()
    listed = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            digest, rel = line.split(maxsplit=1)
            listed[rel.strip()] = digest
    return listed


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Verification:
    ok: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.missing and not self.changed


def verify(root: str | os.PathLike, name: str = "skullfix", progress=None) -> Verification:
    """Hash every file of ``name``'s list under ``root``; ``progress(done, total, rel)`` after each."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such folder; give the dataset's root (the folder holding complete_skull/)")
    listed = known_checksums(name)
    result = Verification()
    for i, (rel, digest) in enumerate(sorted(listed.items())):
        path = root / rel
        if not path.is_file():
            result.missing.append(rel)
        elif sha256_of(path) != digest:
            result.changed.append(rel)
        else:
            result.ok.append(rel)
        if progress:
            progress(i + 1, len(listed), rel)
    return result
