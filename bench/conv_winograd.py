"""Winograd 3x3x3 convolutions in plain PyTorch against the network's oneDNN call (issue 27).

PVCNN2's 3-D convolutions run at 90-100 % of this machine's measured convolution peak, so
the only way under their floor is fewer multiplications: Winograd's minimal filtering
F(m, 3) computes m outputs per axis from m + 2 inputs with (m + 2)^3 products per tile
of m^3 outputs instead of 27 m^3 (Lavin and Gray, "Fast Algorithms for Convolutional
Neural Networks", CVPR 2016). This script builds F(2, 3) and F(4, 3) for 3-D grids
from PyTorch ops (input tiles unfolded and transformed one axis at a time, one batched
matrix product per tile position, the output transform one axis at a time) and times
them against ``pvcnn_blocks._conv3d`` at the paper preset's grid shapes, with each
result's largest difference from a float64 convolution.

    python bench/conv_winograd.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from _common import machine, print_table, record_header, write_json
from pointforge.devices import reuse_freed_memory
from pointforge.nn.pvcnn_blocks import _conv3d

# (resolution, channels in, channels out, batch): the paper preset's PVConv grids.
SHAPES = [(32, 32, 32, 1), (32, 64, 64, 1), (16, 128, 128, 1), (8, 256, 256, 1), (32, 64, 64, 2), (16, 128, 128, 2)]


def winograd_matrices(m: int) -> tuple[Tensor, Tensor, Tensor]:
    """B^T (input), G (filter) and A^T (output) of F(m, 3), m = 2 or 4, in float64."""
    if m == 2:
        bt = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
        g = [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]]
        at = [[1, 1, 1, 0], [0, 1, -1, -1]]
    elif m == 4:
        bt = [
            [4, 0, -5, 0, 1, 0],
            [0, -4, -4, 1, 1, 0],
            [0, 4, -4, -1, 1, 0],
            [0, -2, -1, 2, 1, 0],
            [0, 2, -1, -2, 1, 0],
            [0, 4, 0, -5, 0, 1],
        ]
        g = [
            [1 / 4, 0, 0],
            [-1 / 6, -1 / 6, -1 / 6],
            [-1 / 6, 1 / 6, -1 / 6],
            [1 / 24, 1 / 12, 1 / 6],
            [1 / 24, -1 / 12, 1 / 6],
            [0, 0, 1],
        ]
        at = [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]
    else:
        raise ValueError(f"F({m}, 3) is not built here; m must be 2 or 4")
    return tuple(torch.tensor(a, dtype=torch.float64) for a in (bt, g, at))  # type: ignore[return-value]


def winograd_conv3d(x: Tensor, weight: Tensor, bias: Tensor, m: int) -> Tensor:
    """``F.conv3d(x, weight, bias, padding=1)`` for cubic grids, by F(m, 3) tiles."""
    bt, g, at = (a.to(x.dtype) for a in winograd_matrices(m))
    a = m + 2
    batch, channels, res = x.shape[:3]
    tiles = -(-res // m)
    out_channels = weight.shape[0]
    u = torch.einsum("ai,bj,ck,oxijk->abcxo", g, g, g, weight).reshape(a**3, channels, out_channels)
    extra = tiles * m - res
    v = F.pad(x, (1, 1 + extra) * 3).permute(0, 2, 3, 4, 1)  # [B, D, H, W, C]
    for axis in (1, 2, 3):  # each spatial axis: unfold its tiles, transform them
        v = torch.matmul(v.unfold(axis, a, m), bt.T)
    # v: [B, T, T, T, C, a, a, a] -> one matrix product per tile position.
    v = v.permute(5, 6, 7, 0, 1, 2, 3, 4).reshape(a**3, batch * tiles**3, channels)
    y = torch.bmm(v, u).view(a, a, a, batch, tiles, tiles, tiles, out_channels)
    for axis in (2, 1, 0):
        y = torch.movedim(torch.tensordot(at, y, dims=([1], [axis])), 0, axis)
    # y: [m, m, m, B, T, T, T, Co] -> [B, Co, T*m, T*m, T*m]
    y = y.permute(3, 7, 4, 0, 5, 1, 6, 2).reshape(batch, out_channels, tiles * m, tiles * m, tiles * m)
    return y[:, :, :res, :res, :res] + bias.view(1, -1, 1, 1, 1)


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_shape(res: int, cin: int, cout: int, batch: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    conv = nn.Conv3d(cin, cout, 3, padding=1)
    x = torch.randn(batch, cin, res, res, res)
    with torch.no_grad():
        exact = F.conv3d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
        row: dict[str, Any] = {"shape": [res, cin, cout, batch]}
        for name, fn in [
            ("oneDNN", lambda: _conv3d(conv, x)),
            ("F(2,3)", lambda: winograd_conv3d(x, conv.weight, conv.bias, 2)),
            ("F(4,3)", lambda: winograd_conv3d(x, conv.weight, conv.bias, 4)),
        ]:
            error = (fn().double() - exact).abs().max().item()
            row[name] = {"seconds": median_seconds(fn, repeats), "max_abs_error": error}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--name", default="conv_winograd", help="results file bench/results/NAME.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reuse_freed_memory()
    load_before = os.getloadavg()
    print(machine(), f"| cpu, {args.threads} threads, float32, median of {args.repeats}")
    rows = [run_shape(*shape, args.repeats) for shape in SHAPES]
    table = []
    for row in rows:
        res, cin, cout, batch = row["shape"]
        cells: list[Any] = [f"{res}^3, {cin} -> {cout}, batch {batch}"]
        for name in ("oneDNN", "F(2,3)", "F(4,3)"):
            cells += [1e3 * row[name]["seconds"], row[name]["max_abs_error"]]
        table.append(cells)
    headers = ["grid", "oneDNN ms", "error", "F(2,3) ms", "error", "F(4,3) ms", "error"]
    print_table(headers, table)
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average {load['before'][0]:.1f} before, {load['after'][0]:.1f} after; errors against float64")
    record = record_header("conv_winograd", device="cpu", bf16=False, threads=args.threads, load=load)
    record["shapes"] = rows
    print(f"wrote {write_json(args.name, record)}")


if __name__ == "__main__":
    main()
