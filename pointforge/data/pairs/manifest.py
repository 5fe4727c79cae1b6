"""Pair manifests: the sparse/dense pairs a CSV or JSON file lists, read and written.

A *manifest* lists the pairs, one per row, paths relative to the manifest's
folder (absolute paths also work):

* CSV with a header naming ``sparse`` and ``dense`` columns, optionally ``id``;
* JSON: a list of ``{"sparse": ..., "dense": ..., "id": ...}`` objects, or an
  object with such a list under ``"pairs"``.

Each cloud is ``.npy``, ``.ply``, ``.las`` or ``.laz`` (:mod:`pointforge.data.pointio`).
Without an ``id`` a pair is named after its sparse file's stem.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pointforge.data.pointio import atomic_write, point_format
from pointforge.errors import DataError


@dataclass(frozen=True)
class PairEntry:
    pair_id: str
    sparse: Path
    dense: Path


def _resolve(base: Path, value: str, manifest: Path, row: int, column: str) -> Path:
    value = (value or "").strip()
    if not value:
        raise DataError(f"{manifest}: pair {row} has an empty '{column}' path; fill it in or remove the row")
    path = Path(value)
    return path if path.is_absolute() else base / path


def read_manifest(path: str | os.PathLike) -> list[PairEntry]:
    """The pairs a CSV or JSON manifest lists (module docs), checked to exist and be readable formats."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such manifest; give a CSV or JSON file listing sparse,dense pairs")
    base = path.parent
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read manifest ({err})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: not valid JSON ({err}); fix the manifest") from None
        rows = data.get("pairs") if isinstance(data, dict) else data
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise DataError(
                f"{path}: JSON manifest must be a list of {{sparse, dense, id}} objects (or hold one under 'pairs')"
            )
    elif path.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        fields = [f.strip() for f in (reader.fieldnames or [])]
        if "sparse" not in fields or "dense" not in fields:
            raise DataError(f"{path}: CSV manifest needs a header with 'sparse' and 'dense' columns (found {fields})")
        rows = [{(k or "").strip(): v for k, v in r.items()} for r in reader]
    else:
        raise DataError(f"{path}: manifest must be a .csv or .json file")
    entries: list[PairEntry] = []
    seen: dict[str, int] = {}
    for n, row in enumerate(rows, start=1):
        sparse = _resolve(base, str(row.get("sparse") or ""), path, n, "sparse")
        dense = _resolve(base, str(row.get("dense") or ""), path, n, "dense")
        for p in (sparse, dense):
            point_format(p)
            if not p.is_file():
                raise DataError(f"{path}: pair {n} lists {p}, which does not exist; fix the path or remove the row")
        pair_id = str(row.get("id") or "").strip() or sparse.stem
        if pair_id in seen:
            raise DataError(f"{path}: pairs {seen[pair_id]} and {n} share the id {pair_id!r}; ids must be unique")
        seen[pair_id] = n
        entries.append(PairEntry(pair_id=pair_id, sparse=sparse, dense=dense))
    if not entries:
        raise DataError(f"{path}: manifest lists no pairs")
    return entries


def write_manifest(path: str | os.PathLike, entries: Sequence[PairEntry]) -> Path:
    """A CSV manifest (id,sparse,dense), paths relative to its folder where possible; atomic."""
    path = Path(path)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["id", "sparse", "dense"])
    folder = path.parent.resolve()

    def relative(p: str | Path) -> str:
        return os.path.relpath(Path(p).resolve(), folder) if Path(p).is_absolute() else str(p)

    for e in entries:
        writer.writerow([e.pair_id, relative(e.sparse), relative(e.dense)])
    payload = buffer.getvalue().encode()

    def write(tmp):
        with open(tmp, "wb") as fh:
            fh.write(payload)

    return atomic_write(path, write)
