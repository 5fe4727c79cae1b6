"""DPSR time and peak memory: pointforge's solver beside a straightforward one.

Each configuration (implementation x grid x cloud size x forward / forward+backward)
runs in a fresh subprocess, so its peak resident memory (ru_maxrss) is its own.
"working" memory is that peak minus the resident size after imports and inputs
(the incoming gradient grid of a backward pass counts, for both solvers). Times
are wall-clock, the fastest of the timed runs after one warm-up (a single cold
run at 512^3) over --rounds fresh processes; "CPU s" is the process's
user+system time for that run. On a shared machine other load inflates both;
the solvers alternate (bench/_common.py's harness) so that it inflates them alike.
The straightforward solver below is the direct way to write the same function
(all three normal channels rasterised and transformed at once, full-size
frequency grids, autograd for the backward pass); it is checked equal to
pointforge's before anything is timed, and it is what the ratios compare against.

    python bench/dpsr.py                       # 128/256/512, 30k and 215k points
    python bench/dpsr.py --res 128 256 --points 30000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from _common import alternate, fresh_process, machine, print_table, write_json  # noqa: E402
from pointforge.nn.dpsr import dpsr, dpsr_memory_bytes  # noqa: E402

SIGMA = 2.0
# pointforge runs with its default backend (on a CPU the compiled path: ducc0's FFTs and the
# pruned solve) and, to separate that path's share of the gain, with the plain torch.fft path
# (its CUDA path).
IMPL_BACKEND = {"pointforge": "auto", "pointforge-torchfft": "plain"}


def straightforward_dpsr(points: torch.Tensor, normals: torch.Tensor, res: tuple[int, int, int], sigma: float):
    """DPSR written the direct way; autograd differentiates it."""
    batch, n, _ = points.shape
    size = torch.tensor(res, dtype=points.dtype)
    cell = 1.0 / size
    low = torch.floor(points / cell)
    frac_upper = (points - low * cell).abs() / cell
    frac_lower = (points - (low + 1) * cell).abs() / cell
    bits = torch.tensor([[b >> 2 & 1, b >> 1 & 1, b & 1] for b in range(8)])  # (8, 3)
    nodes = (low.long()[:, :, None, :] + bits) % torch.tensor(res)  # (b, n, 8, 3)
    flat = (nodes[..., 0] * res[1] + nodes[..., 1]) * res[2] + nodes[..., 2]  # (b, n, 8)
    weight = torch.where(bits.bool(), frac_upper[:, :, None, :], frac_lower[:, :, None, :]).prod(-1)  # (b, n, 8)

    values = (normals[:, :, None, :] * weight[..., None]).permute(0, 3, 1, 2).reshape(batch, 3, -1)
    index = flat.reshape(batch, 1, -1).expand(batch, 3, -1)
    raster = points.new_zeros(batch, 3, math.prod(res)).scatter_add(2, index, values).view(batch, 3, *res)

    spectrum = torch.fft.rfftn(raster, dim=(2, 3, 4))
    k = torch.meshgrid(
        torch.fft.fftfreq(res[0], 1 / res[0]),
        torch.fft.fftfreq(res[1], 1 / res[1]),
        torch.fft.rfftfreq(res[2], 1 / res[2]),
        indexing="ij",
    )
    omega = torch.stack(k) * (2 * math.pi)  # (3, r0, r1, r2 // 2 + 1)
    gauss = torch.exp(-0.5 * (2 * sigma * torch.stack(k).norm(dim=0) / res[0]) ** 2)
    divergence = (-1j * omega * spectrum * gauss).sum(1)
    phi_hat = divergence / (-(omega**2).sum(0) + 1e-6)
    phi_hat[:, 0, 0, 0] = 0
    phi = torch.fft.irfftn(phi_hat, s=res, dim=(1, 2, 3))

    at_points = (phi.reshape(batch, -1).gather(1, flat.reshape(batch, -1)).view(batch, n, 8) * weight).sum(-1)
    phi = phi - at_points.mean(1).view(batch, 1, 1, 1)
    return -phi / phi[:, 0, 0, 0].abs().view(batch, 1, 1, 1) * 0.5


def sphere_cloud(n: int, seed: int = 0):
    """n points on a sphere (centre 0.5, radius 0.3, slight radial noise) with outward normals."""
    g = torch.Generator().manual_seed(seed)
    normals = torch.randn(1, n, 3, generator=g)
    normals = normals / normals.norm(dim=-1, keepdim=True)
    radius = 0.3 + 0.003 * torch.randn(1, n, 1, generator=g)
    return 0.5 + radius * normals, normals


def run_one(impl: str, res: int, n_points: int, backward: bool, threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    shape = (res, res, res)
    points, normals = sphere_cloud(n_points)
    # Memory is counted from here: the incoming gradient grid of a backward pass is
    # part of what each solver needs, so it counts for both.
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    upstream = torch.randn(1, *shape, generator=torch.Generator().manual_seed(1)) if backward else None
    if impl == "straightforward":
        solve = lambda p, n: straightforward_dpsr(p, n, shape, SIGMA)  # noqa: E731
    else:
        backend = IMPL_BACKEND[impl]
        solve = lambda p, n: dpsr(p, n, shape, SIGMA, backend=backend)  # noqa: E731
    times, cpu_times = [], []
    for _ in range(repeats):
        p = points.clone().requires_grad_(backward)
        n = normals.clone().requires_grad_(backward)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out = solve(p, n)
            if backward:
                out.backward(upstream)
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu_times.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
        del out, p, n
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # The first run pays one-off FFT planning; of the rest the fastest is the
    # least disturbed by other work on a shared machine.
    timed = times[1:] if len(times) > 1 else times
    cpu = cpu_times[1:] if len(cpu_times) > 1 else cpu_times
    return {
        "impl": impl,
        "res": res,
        "points": n_points,
        "mode": "fwd+bwd" if backward else "fwd",
        "runs": len(timed),
        "time_s": min(timed),
        "time_median_s": statistics.median(timed),
        "cpu_s": min(cpu),
        "load_average": os.getloadavg()[0],
        "peak_rss_gib": peak / 2**30,
        "peak_above_start_gib": (peak - rss_start) / 2**30,
        "estimate_gib": dpsr_memory_bytes(res, n_points, 1, requires_grad=backward) / 2**30
        if impl in IMPL_BACKEND
        else None,
    }


def check_equal() -> float:
    """Both solvers compute the same function (and gradients), on a small grid."""
    points, normals = sphere_cloud(3000, seed=2)
    grads = []
    outs = []
    for solve in (lambda p, n: dpsr(p, n, 32, SIGMA), lambda p, n: straightforward_dpsr(p, n, (32, 32, 32), SIGMA)):
        p, n = points.clone().requires_grad_(), normals.clone().requires_grad_()
        out = solve(p, n)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append((p.grad, n.grad))
    value = (outs[0] - outs[1]).abs().max().item()
    grad = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(grads[0], grads[1]))
    if value > 1e-5 or grad > 1e-4:
        raise SystemExit(f"the two solvers disagree (value {value:.2e}, relative gradient {grad:.2e})")
    return value


def _child(impl: str, res: int, n_points: int, backward: bool, threads: int) -> dict:
    args = ["--threads", str(threads), "--child", impl, str(res), str(n_points), "1" if backward else "0"]
    found = fresh_process(__file__, args, check=False)
    if "error" in found:
        return {"impl": impl, "res": res, "points": n_points, "mode": "fwd+bwd" if backward else "fwd", **found}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--res", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--points", type=int, nargs="+", default=[30_000, 215_000])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-baseline", action="store_true", help="time pointforge's solver only")
    parser.add_argument(
        "--baseline-max-res", type=int, default=512, help="skip the straightforward solver above this grid"
    )
    parser.add_argument("--rounds", type=int, default=2, help="fresh-process runs per configuration and solver")
    parser.add_argument("--child", nargs=4, metavar=("IMPL", "RES", "POINTS", "BACKWARD"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        impl, res, n_points, backward = args.child
        res = int(res)
        repeats = 4 if res <= 128 else 2 if res <= 256 else 1
        print(json.dumps(run_one(impl, res, int(n_points), backward == "1", args.threads, repeats)))
        return

    torch.set_num_threads(args.threads)
    info = machine()
    print(f"DPSR benchmark on {info}; sigma {SIGMA}")
    print(f"straightforward vs pointforge at 32^3: max |difference| {check_equal():.1e}")
    rows = []
    impls = list(IMPL_BACKEND) + ([] if args.no_baseline else ["straightforward"])
    for res in args.res:
        for n_points in args.points:
            for backward in (False, True):
                # Implementations alternate within each round, so a burst of other
                # load on a shared machine hits them alike; the fastest round counts.
                names = [i for i in impls if i != "straightforward" or res <= args.baseline_max_res]
                runs = alternate(
                    names,
                    args.rounds,
                    lambda i, r: _child(names[i], res, n_points, backward, args.threads),
                    label=f"{res}^3 {n_points} pts {'fwd+bwd' if backward else 'fwd'}: ",
                ).runs
                for impl, results in runs.items():
                    timed = [r for r in results if "time_s" in r]
                    row = min(timed, key=lambda r: r["time_s"]) if timed else results[-1]
                    row["rounds"] = len(timed)
                    rows.append(row)
                    print(
                        f"  {impl:19s} {res}^3 {n_points:7d} pts {row['mode']:8s} "
                        + (
                            f"{row['time_s']:8.2f} s  peak {row['peak_rss_gib']:.2f} GiB"
                            if "time_s" in row
                            else row["error"]
                        ),
                        flush=True,
                    )

    # Ratios side by side: straightforward / pointforge for the same configuration.
    by_key = {(r["impl"], r["res"], r["points"], r["mode"]): r for r in rows}
    for r in rows:
        other = by_key.get(("straightforward", r["res"], r["points"], r["mode"]))
        if r["impl"] in IMPL_BACKEND and other and "time_s" in other and "time_s" in r:
            r["speedup"] = other["time_s"] / r["time_s"]
            if min(other["peak_above_start_gib"], r["peak_above_start_gib"]) > 0.02:  # else allocator noise
                r["memory_ratio"] = other["peak_above_start_gib"] / r["peak_above_start_gib"]
    print()
    columns = [
        ("impl", "impl"),
        ("res", "grid"),
        ("points", "points"),
        ("mode", "mode"),
        ("time_s", "time s"),
        ("cpu_s", "CPU s"),
        ("peak_rss_gib", "peak RSS GiB"),
        ("peak_above_start_gib", "working GiB"),
        ("estimate_gib", "estimate GiB"),
        ("speedup", "x faster"),
        ("memory_ratio", "x leaner"),
        ("rounds", "rounds"),
        ("error", "error"),
    ]
    print_table([title for _, title in columns], [[r.get(key, "") for key, _ in columns] for r in rows])
    path = write_json("dpsr", {"machine": info, "sigma": SIGMA, "threads": args.threads, "rows": rows})
    print(f"\nwrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
