"""The upsampler on held-out real airborne lidar: trained models against geometry, per tile and surface type.

Pairs come from ``pointforge data lidar`` (:mod:`pointforge.data.lidar`): the
public scans (Nîmes, city; a conifer forest) cut into 30 m tiles, split by
area, sparse clouds by each thinning protocol. Only the **test** tiles (an
area no model trained or validated on) are scored. Methods, each r·N points:

* every ``--ckpt LABEL=PATH`` (a trained upsampler);
* ``start``: the plane-start checkpoints' geometric start (output heads
  zeroed: the children on the local planes, what the network corrects), one
  row per kind of start (``start`` over the graph, ``start plane_k 10``);
* ``plane`` (local-plane fit) and ``midpoint`` (k-NN edge midpoints), the baselines.

Per tile: Chamfer (m²) and point-to-surface (m) of :mod:`pointforge.upsampling.metrics`,
and the same per surface type (:mod:`pointforge.data.lidar.surfaces`; the
scans carry no classification, so the geometric proxy flat / steep / rough):
a predicted point takes the type of its nearest dense point; a type's Chamfer
is the mean squared distance of its predicted points to the truth plus that of
its dense points to the prediction. A tile "wins" when a method beats the
plane fit on both Chamfer and point-to-surface.

    python bench/upsampler_real.py --pairs data/upsampler/lidar --ckpt synthetic=runs/upsampler/small/checkpoints/best.pt
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from scipy.spatial import cKDTree

from _common import machine, print_table, write_json
from pointforge.data.lidar.surfaces import surface_types
from pointforge.data.pairs.manifest import read_manifest
from pointforge.inference.upsampler import load_upsampler
from pointforge.upsampling.baselines import upsample_baseline
from pointforge.upsampling.metrics import nearest_distances, plane_distances
from pointforge.upsampling.pipeline import upsample_points


def read_las(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import laspy

    las = laspy.read(path)
    return np.column_stack([las.x, las.y, las.z]), np.asarray(las.classification)


def start_of(upsampler):
    """The network with its coarse and fine offset heads zeroed: its output is where its children start."""
    net = copy.deepcopy(upsampler.model)
    for head in (net.coarse, net.decode[-1][-1]):
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    return net


def score(pred: np.ndarray, truth: np.ndarray, types: np.ndarray) -> dict:
    """Chamfer and point-to-surface, overall and per surface type (module docs)."""
    truth_tree = cKDTree(truth)
    to_truth = nearest_distances(pred, truth_tree)
    to_pred = nearest_distances(truth, cKDTree(pred))
    surface = plane_distances(pred, truth, truth_tree, 10, 1 << 18, 1)
    pred_types = types[truth_tree.query(pred, k=1)[1]]
    out = {"chamfer": float(np.mean(to_truth**2) + np.mean(to_pred**2)), "p2s": float(surface.mean())}
    for name in np.unique(types):
        mine, theirs = pred_types == name, types == name
        if mine.sum() >= 20 and theirs.sum() >= 20:
            out[f"chamfer_{name}"] = float(np.mean(to_truth[mine] ** 2) + np.mean(to_pred[theirs] ** 2))
            out[f"p2s_{name}"] = float(surface[mine].mean())
    return out


def predict(method: str, networks: dict, sparse: np.ndarray, ratio: int) -> np.ndarray:
    if method in networks:
        net, normalization = networks[method]
        return upsample_points(net, sparse, normalization=normalization)
    return upsample_baseline(method, sparse, ratio)


def run_protocol(root: Path, protocol: str, networks: dict, ratio: int) -> list[dict]:
    rows = []
    for entry in read_manifest(root / protocol / "test.csv"):
        sparse, _ = read_las(entry.sparse)
        dense, classes = read_las(entry.dense)
        types = surface_types(dense, classes)
        for method in (*networks, "plane", "midpoint"):
            started = time.perf_counter()
            pred = predict(method, networks, sparse, ratio)
            seconds = time.perf_counter() - started
            row = {"protocol": protocol, "tile": entry.pair_id, "scan": entry.pair_id.split("_")[0], "method": method}
            rows.append(row | score(pred, dense, types) | {"seconds": seconds, "sparse_points": len(sparse)})
    return rows


def summarise(rows: list[dict]) -> list[list]:
    """Per protocol, scan and method: mean Chamfer, mean P2S, tiles beating the plane fit on each and both."""
    plane = {(r["protocol"], r["tile"]): r for r in rows if r["method"] == "plane"}
    table = []
    for key in sorted({(r["protocol"], r["scan"], r["method"]) for r in rows}, key=lambda k: (k[0], k[1])):
        group = [r for r in rows if (r["protocol"], r["scan"], r["method"]) == key]
        base = [plane[(r["protocol"], r["tile"])] for r in group]
        beat_c = sum(r["chamfer"] < b["chamfer"] for r, b in zip(group, base))
        beat_p = sum(r["p2s"] < b["p2s"] for r, b in zip(group, base))
        both = sum(r["chamfer"] < b["chamfer"] and r["p2s"] < b["p2s"] for r, b in zip(group, base))
        mean = {m: float(np.mean([r[m] for r in group])) for m in ("chamfer", "p2s")}
        table.append([*key, mean["chamfer"], mean["p2s"], f"{beat_c}/{beat_p}/{both} of {len(group)}"])
    return table


def by_surface(rows: list[dict]) -> list[list]:
    """Per protocol, method and surface type: Chamfer and P2S, means over the tiles that have the type."""
    types = sorted({k.split("_", 1)[1] for r in rows for k in r if k.startswith("chamfer_")})
    table = []
    for protocol, method in sorted({(r["protocol"], r["method"]) for r in rows}):
        group = [r for r in rows if r["protocol"] == protocol and r["method"] == method]
        for name in types:
            have = [r for r in group if f"chamfer_{name}" in r]
            if have:
                table.append([protocol, method, name, len(have), *(
                    float(np.mean([r[f"{m}_{name}"] for r in have])) for m in ("chamfer", "p2s")
                )])  # fmt: skip
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=Path, required=True, help="folder written by `pointforge data lidar`")
    parser.add_argument("--ckpt", action="append", default=[], help="LABEL=PATH of a trained upsampler (repeatable)")
    parser.add_argument("--protocol", action="append", help="thinning protocol(s) to score (default: all built)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="upsampler_real", help="bench/results/<name>.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    networks, ratio = {}, 2
    for spec in args.ckpt:
        label, _, path = spec.partition("=")
        upsampler = load_upsampler(path, "cpu")
        networks[label] = (upsampler, upsampler.normalization)
        ratio = upsampler.ratio
    starts = {}
    for upsampler, normalization in list(networks.values()):
        config = upsampler.model.config
        label = "start" + (f" plane_k {config.plane_k}" if config.plane_k else "")
        if config.start == "plane" and label not in starts:
            starts[label] = (start_of(upsampler), normalization)
    networks |= starts
    built = json.loads((args.pairs / "tiles.json").read_text())
    protocols = args.protocol or sorted({k.split("/")[0] for k in built["manifests"] if k.endswith("/test")})
    rows = [row for p in protocols for row in run_protocol(args.pairs, p, networks, ratio)]

    load = os.getloadavg()
    print(f"machine: {machine()}; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print_table(["protocol", "scan", "method", "Chamfer m²", "P2S m", "beats plane: C/P/both"], summarise(rows))
    print()
    print_table(["protocol", "method", "surface", "tiles", "Chamfer m²", "P2S m"], by_surface(rows))
    record = {"machine": machine(), "load_average": load, "torch": torch.__version__, "checkpoints": args.ckpt}
    record |= {"protocols": protocols, "summary": summarise(rows), "surfaces": by_surface(rows), "tiles": rows}
    print(f"wrote {write_json(args.name, record)}")


if __name__ == "__main__":
    main()
