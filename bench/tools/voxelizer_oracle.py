"""Oracle implant DSC of a voxelizer checkpoint on a dataset's test split (the demo recipe's yardstick).

For every test case: a random subsample of the defective skull's surface points
plus the TRUE implant surface points (voxel-index coordinates, as prepared) ->
points_to_volume -> implant_from_proposals (upstream's chain, defaults) ->
evaluate_case against the true implant. That is the whole pipeline's upper bound
with a perfect PCDiff. Also: the implant points jittered by Gaussian noise of
1, 2, 4 mm (a PCDiff close but not exact), votes of 5 jittered proposals,
the completed skull's volume IoU, the implant without post-processing
(``dsc_raw_near``: completed minus defective, near the implant points) and,
with --pp, the chain's own losses (on the true complete skull, dilate 0, ...).

A measuring script kept with the numbers it produced (pointforge/configs/voxelizer/demo.yaml,
bench/voxelizer_demo.md), not one of the benchmarks ``make bench`` runs. It calls the
chain without a spacing, i.e. upstream's fixed 3³ sizes; ``pointforge generate`` now
sizes them in millimetres (pointforge/implant/postprocess.py).

usage (PREPARED from prepare_dataset, RAW the synthesize() folder it came from):
  PYTHONPATH=. python bench/tools/voxelizer_oracle.py CKPT PREPARED RAW \
      [--n-skull 896 --n-implant 128] [--quick] [--pp] [--resolution 96] [--json out.json]
"""

import argparse
import json
import time
from collections import defaultdict

import numpy as np
import torch

from pointforge.data.skulls.prepared import PreparedDataset
from pointforge.data.volumes import read_binary_volume, read_volume
from pointforge.implant.metrics import evaluate_case
from pointforge.implant.postprocess import implant_from_proposals
from pointforge.implant.voxelize import points_to_volume
from pointforge.inference.voxelizer import load_voxelizer

ap = argparse.ArgumentParser()
ap.add_argument("ckpt")
ap.add_argument("prepared")
ap.add_argument("raw")
ap.add_argument("--n-skull", type=int, default=1792)
ap.add_argument("--n-implant", type=int, default=256)
ap.add_argument("--quick", action="store_true", help="clean + 2mm only")
ap.add_argument("--resolution", type=int, default=None)
ap.add_argument("--json", default=None)
ap.add_argument("--pp", action="store_true", help="post-processing ablations")
args = ap.parse_args()
torch.set_num_threads(1)

loaded = load_voxelizer(args.ckpt)
model, cfg = loaded.model, loaded.run_config
data = PreparedDataset(args.prepared)
cases = data.split("test", require=("implant", "complete_mask"))


def sub(p, n, rng):
    idx = rng.choice(len(p), size=n, replace=len(p) < n)
    return np.asarray(p[idx], dtype=np.float64)


def iou(a, b):
    return float((a & b).sum() / max(1, (a | b).sum()))


res = defaultdict(list)
times = []
for ci, case in enumerate(cases):
    dvol = read_volume(f"{args.raw}/defective_skull/{case.defect}/{case.skull_id}.nrrd")
    defective = dvol.data.astype(bool)
    truth = read_binary_volume(f"{args.raw}/implant/{case.defect}/{case.skull_id}.nrrd").data.astype(bool)
    complete = read_binary_volume(f"{args.raw}/complete_skull/{case.skull_id}.nrrd").data.astype(bool)
    spacing = dvol.spacing
    vox_mm = float(spacing[0])
    skull_pts = data.points(case.defective)
    imp_pts = data.points(case.implant)
    rng = np.random.default_rng(1000 + ci)

    def proposal(sigma_mm, r):
        s = sub(skull_pts, args.n_skull, r)
        i = sub(imp_pts, args.n_implant, r)
        if sigma_mm > 0:
            i = i + r.normal(0, sigma_mm / vox_mm, i.shape)
            i = np.clip(i, 0, np.asarray(defective.shape) - 1)
        t = time.perf_counter()
        m = points_to_volume(model, np.concatenate([s, i]), dvol, resolution=args.resolution).data
        times.append(time.perf_counter() - t)
        return m, i

    def score(masks, ipts):
        imp, _ = implant_from_proposals(masks, defective, ipts)
        return evaluate_case(imp, truth, defective, spacing)

    res["defect"].append(case.defect)
    # clean
    m, i = proposal(0.0, rng)
    res["iou"].append(iou(m, complete))
    # IoU of the completed skull restricted to the defect region (truth implant dilated)
    r0 = score([m], i)
    res["dsc_clean"].append(r0["dsc"])
    res["bdsc_clean"].append(r0["bdsc"])
    res["hd95_clean"].append(r0["hd95"])
    # raw implant region without post-processing
    raw = m & ~defective
    from pointforge.implant.postprocess import near_points

    raw_near = raw & near_points(defective.shape, i)
    res["dsc_raw_near"].append(evaluate_case(raw_near, truth, defective, spacing)["dsc"])
    if args.pp:
        # chain on the TRUE complete skull (upper bound of the chain itself)
        res["pp_truecomplete"].append(
            evaluate_case(implant_from_proposals([complete], defective, i)[0], truth, defective, spacing)["dsc"]
        )
        res["pp_truecomplete_dil0"].append(
            evaluate_case(implant_from_proposals([complete], defective, i, dilate=0)[0], truth, defective, spacing)[
                "dsc"
            ]
        )
        res["pp_dil0"].append(
            evaluate_case(implant_from_proposals([m], defective, i, dilate=0)[0], truth, defective, spacing)["dsc"]
        )
        res["pp_dil0_noclean"].append(evaluate_case(raw_near, truth, defective, spacing)["dsc"])
        res["pp_dil1_noclean"].append(
            evaluate_case(
                implant_from_proposals([m], defective, i)[1].full_mask(defective.shape)
                & ~defective
                & near_points(defective.shape, i),
                truth,
                defective,
                spacing,
            )["dsc"]
        )
        res["pp_r1.3"].append(
            evaluate_case(implant_from_proposals([m], defective, i, radius_factor=1.3)[0], truth, defective, spacing)[
                "dsc"
            ]
        )
    sigmas = [2.0] if args.quick else [1.0, 2.0, 4.0]
    for s in sigmas:
        m, i = proposal(s, rng)
        r = score([m], i)
        res[f"dsc_j{s:g}"].append(r["dsc"])
    # vote of 5 proposals jittered by 2 mm (different skull subsamples too)
    vs = [2.0] if args.quick else [2.0, 4.0]
    for s in vs:
        ms, ips = zip(*[proposal(s, rng) for _ in range(5)])
        r = score(list(ms), np.concatenate(ips))
        res[f"dsc_vote5_j{s:g}"].append(r["dsc"])
        if args.pp and s == 2.0:
            res["pp_vote5_j2_dil0"].append(
                evaluate_case(
                    implant_from_proposals(list(ms), defective, np.concatenate(ips), dilate=0)[0],
                    truth,
                    defective,
                    spacing,
                )["dsc"]
            )

keys = [k for k in res if k != "defect"]
out = {
    "ckpt": args.ckpt,
    "n_skull": args.n_skull,
    "n_implant": args.n_implant,
    "resolution": args.resolution,
    "time_per_proposal_s": float(np.median(times)),
    "mean": {},
    "per_class": {},
}
for k in keys:
    out["mean"][k] = float(np.nanmean(res[k]))
for d in sorted(set(res["defect"])):
    sel = [j for j, x in enumerate(res["defect"]) if x == d]
    out["per_class"][d] = {k: float(np.nanmean([res[k][j] for j in sel])) for k in keys}
print(json.dumps(out["mean"]), "t/prop=%.3f" % out["time_per_proposal_s"])
if args.json:
    json.dump(out, open(args.json, "w"), indent=1)
