"""Train/val/test splits grouped by skull, so that no skull is in two splits.

A split is given as text, one of:

* ratios, ``"0.7,0.1,0.2"`` (train, val, test): a seeded random split of the skulls found;
* skull ids, ``"train=000-059,val=060-069,test=070-079"``: each skull named (single ids or
  inclusive numeric ranges, joined by ``+``, e.g. ``train=000-049+055``), the same for everyone.
  Skulls it does not name are left out of the dataset and never read;
* a name from :data:`NAMED_SPLITS`, e.g. ``skullfix``: the fixed split of the SkullFix
  training set used by pointforge's real-skull recipe (docs/data.md).
"""

from __future__ import annotations

import math
import re

import numpy as np

from pointforge.errors import ConfigError

SPLITS = ("train", "val", "test")

# SkullFix (AutoImplant 2020 task 1, 100 skulls 000-099): 000-079 are split for training,
# choosing and testing; 080-099 are kept out as a release check that no recipe ever reads.
NAMED_SPLITS = {
    "skullfix": "train=000-059,val=060-069,test=070-079",
    # The same 60 training skulls with the validation skulls as the test split and 5 training
    # skulls for choosing: for tuning a recipe without touching the test skulls.
    "skullfix-tune": "train=000-054,val=055-059,test=060-069",
}

_RANGE = re.compile(r"^(\d+)-(\d+)$")


def parse_ratios(text: str | tuple[float, ...]) -> tuple[float, float, float]:
    """'0.7,0.1,0.2' (train, val, test) → normalised tuple."""
    try:
        values = [float(v) for v in (text.split(",") if isinstance(text, str) else text)]
    except ValueError:
        raise ConfigError(
            f"split ratios {text!r} are not numbers; write them like 0.7,0.1,0.2 (train,val,test)"
        ) from None
    if len(values) == 2:
        values = [values[0], 0.0, values[1]]
    if len(values) != 3 or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
        raise ConfigError(
            f"split ratios {text!r} must be 2 or 3 non-negative numbers (train,[val,]test), e.g. 0.7,0.1,0.2"
        )
    total = sum(values)
    return tuple(v / total for v in values)  # type: ignore[return-value]


def _id_matches(item: str) -> tuple[int, int] | str:
    """One item of a skull list: an inclusive numeric range ``(low, high)`` or a single id."""
    found = _RANGE.match(item)
    if found:
        low, high = int(found.group(1)), int(found.group(2))
        if low > high:
            raise ConfigError(f"skull range {item!r} runs backwards; write it low-high, e.g. 000-059")
        return low, high
    if not item or any(c in item for c in "=,"):
        raise ConfigError(f"skull id {item!r} is empty or malformed")
    return item


def parse_skull_ids(text: str) -> dict[str, list[tuple[int, int] | str]]:
    """``train=000-059,val=060-069,test=070-079`` → the items of each split (ranges or single ids)."""
    text = NAMED_SPLITS.get(text.strip(), text)
    parts: dict[str, list[tuple[int, int] | str]] = {}
    for chunk in text.split(","):
        name, sep, items = chunk.partition("=")
        name = name.strip()
        if not sep or name not in SPLITS:
            raise ConfigError(
                f"split {text!r}: {chunk!r} is not split=ids; write e.g. train=000-059,val=060-069,test=070-079 "
                f"(splits: {', '.join(SPLITS)}; named splits: {', '.join(NAMED_SPLITS)})"
            )
        if name in parts:
            raise ConfigError(f"split {text!r} names {name!r} twice")
        parts[name] = [_id_matches(item.strip()) for item in items.split("+")]
    return parts


def is_id_split(text: str) -> bool:
    """Whether ``text`` names skulls (ids or a named split) rather than giving ratios."""
    return text.strip() in NAMED_SPLITS or "=" in text


def check_split(text: str) -> None:
    """Raise :class:`ConfigError` if ``text`` is neither ratios nor a valid skull-id split."""
    parse_skull_ids(text) if is_id_split(text) else parse_ratios(text)


def _split_of(skull_id: str, parts: dict[str, list[tuple[int, int] | str]]) -> str | None:
    hits = set()
    number = int(skull_id) if skull_id.isdigit() else None
    for name, items in parts.items():
        for item in items:
            if item == skull_id or (isinstance(item, tuple) and number is not None and item[0] <= number <= item[1]):
                hits.add(name)
    if len(hits) > 1:
        raise ConfigError(f"skull {skull_id} is in several splits ({', '.join(sorted(hits))}); a skull belongs to one")
    return hits.pop() if hits else None


def missing_skulls(skull_ids: list[str], split: str) -> list[str]:
    """The skulls a skull-id split names (each single id, every number of a range) that ``skull_ids`` lacks."""
    if not is_id_split(split):
        return []
    present = set(skull_ids)
    numbers = {int(s) for s in present if s.isdigit()}
    width = max((len(s) for s in present if s.isdigit()), default=3)  # ranges lose their zero padding
    missing = []
    for items in parse_skull_ids(split).values():
        for item in items:
            if isinstance(item, tuple):
                missing += [f"{n:0{width}d}" for n in range(item[0], item[1] + 1) if n not in numbers]
            elif item not in present:
                missing.append(item)
    return missing


def assign_skulls(skull_ids: list[str], split: str, seed: int) -> dict[str, str]:
    """Skull id → split name, for ratios (seeded, every skull assigned) or skull ids (only those named)."""
    if not is_id_split(split):
        return split_skulls(skull_ids, parse_ratios(split), seed)
    parts = parse_skull_ids(split)
    assignment = {}
    for skull in sorted(set(skull_ids)):
        name = _split_of(skull, parts)
        if name is not None:
            assignment[skull] = name
    if not assignment:
        raise ConfigError(f"split {split!r} names none of the {len(set(skull_ids))} skulls in the dataset")
    return assignment


def split_skulls(skull_ids: list[str], ratios: tuple[float, float, float], seed: int) -> dict[str, str]:
    """Seeded split of skulls (not cases) so no skull is in two splits.

    Every split with a non-zero ratio gets at least one skull when there are
    enough skulls; the rest goes to train.
    """
    unique = sorted(set(skull_ids))
    n = len(unique)
    order = np.random.default_rng(seed).permutation(n)
    want_test = ratios[2] > 0
    want_val = ratios[1] > 0
    n_test = max(1 if want_test and n >= 2 else 0, int(round(ratios[2] * n)))
    n_val = max(1 if want_val and n >= 3 else 0, int(round(ratios[1] * n)))
    if n_test + n_val >= n:  # keep at least one training skull
        overflow = n_test + n_val - (n - 1)
        n_val = max(0, n_val - overflow)
        n_test = min(n_test, n - 1 - n_val)
    assignment = {}
    for rank, i in enumerate(order):
        if rank < n_test:
            assignment[unique[i]] = "test"
        elif rank < n_test + n_val:
            assignment[unique[i]] = "val"
        else:
            assignment[unique[i]] = "train"
    return assignment
