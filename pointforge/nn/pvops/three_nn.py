"""Three nearest centres of each point, their inverse-distance weights, and the interpolation
of centre features at the points (upstream's ``three_nn`` and ``three_interpolate``).

Weights and ties follow the kernel bit for bit; 3-NN treats coordinates as constants, and
gradients of the interpolation reach the centre features only, as upstream's do.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import Tensor

from pointforge.errors import ConfigError, DataError
from pointforge.nn import backends
from pointforge.nn.pvops.bags import sum_bags, weighted_bags
from pointforge.nn.pvops.cell_grid import CellGrid, block_squared_distance, flat_components
from pointforge.nn.pvops.common import FAR, PAIR_BUDGET, expect_coords, expect_method, squared_distance

__all__ = ["interpolate_from_neighbors", "three_nearest_neighbors", "three_nn_interpolate"]


def _finish_three_nn(d: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Kernel epilogue on ``d, idx [Q, 3]``: slots left empty (d = inf, fewer than three
    centres) point at index 0; distances are clamped to [1e-10, 1e10] and the weights
    formed as the kernel forms them, ``w0 = d1*d2 / (d0*d1 + d0*d2 + d1*d2)`` etc., which
    is the normalised inverse distance up to rounding, but rounded the kernel's way.
    """
    idx = idx.masked_fill(torch.isinf(d), 0)
    lo = float(torch.tensor(1e-10, dtype=torch.float32))  # the kernel's 1e-10f
    d = torch.clamp(torch.clamp(d, max=FAR), min=lo)
    d0, d1, d2 = d.unbind(-1)
    d0d1, d0d2, d1d2 = d0 * d1, d0 * d2, d1 * d2
    inv = 1.0 / ((d0d1 + d0d2) + d1d2)
    return idx, torch.stack([d1d2 * inv, d0d2 * inv, d0d1 * inv], -1)


def _lexsort_rows(d2: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Rows sorted by (distance, id)."""
    ids, order = torch.sort(ids, dim=1)
    d2, order2 = torch.sort(torch.gather(d2, 1, order), dim=1, stable=True)
    return d2, torch.gather(ids, 1, order2)


def _three_smallest(d2: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """The 3 smallest of each row of ``d2 [R, W]`` (W >= 3) ordered by (distance, id).

    This is the order the kernel's strict-"<" insertion produces: among equal distances
    the lower index comes first. ``ids`` are distinct within a row.
    """
    vals, col = torch.topk(d2, 3, dim=1, largest=False, sorted=True)
    vals, top = _lexsort_rows(vals, torch.gather(ids, 1, col))
    # topk may cut a tie at the third distance anywhere: such rows are sorted in full.
    tied = (d2 <= vals[:, 2:3]).sum(1) > 3
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        v, i = _lexsort_rows(d2.index_select(0, rows), ids.index_select(0, rows))
        vals[rows] = v[:, :3]
        top[rows] = i[:, :3]
    return vals, top


def _three_nn_dense(points: Tensor, centers: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(d [Q, 3], idx [Q, 3]) for flat query ids ``rows`` (all queries when None)."""
    b, _, n = points.shape
    m = centers.shape[2]
    px, py, pz = flat_components(points)
    c = centers.detach()
    if rows is None:
        rows = torch.arange(b * n, device=points.device)
    out_d = torch.empty((rows.numel(), 3), dtype=points.dtype, device=points.device)
    out_i = torch.empty((rows.numel(), 3), dtype=torch.long, device=points.device)
    ids = torch.arange(max(m, 3), device=points.device)
    step = max(1, PAIR_BUDGET // max(1, m))
    for lo in range(0, rows.numel(), step):
        r = rows[lo : lo + step]
        bi = torch.div(r, n, rounding_mode="floor")
        d2 = squared_distance(px[r, None], py[r, None], pz[r, None], c[bi, 0], c[bi, 1], c[bi, 2])
        if m < 3:
            d2 = torch.cat([d2, d2.new_full((d2.shape[0], 3 - m), math.inf)], 1)
        out_d[lo : lo + step], out_i[lo : lo + step] = _three_smallest(d2, ids.expand(d2.shape[0], -1))
    return out_d, out_i


def _three_nn_grid(points: Tensor, centers: Tensor, cell: float, attempts: int = 3) -> tuple[Tensor, Tensor]:
    b, _, n = points.shape
    m = centers.shape[2]
    pxyz = flat_components(points)
    cxyz = flat_components(centers)
    out_d = torch.empty((b * n, 3), dtype=points.dtype, device=points.device)
    out_i = torch.empty((b * n, 3), dtype=torch.long, device=points.device)
    pending = torch.arange(b * n, device=points.device)
    for _ in range(attempts):
        grid = CellGrid(centers, points, cell)
        if not grid.usable:
            break
        # A centre outside the 3x3x3 block is at least ``cell`` away; a third distance
        # safely below cell^2 therefore cannot be beaten or tied from outside.
        safe = cell * cell * (1 - 1e-5)
        failed = []
        for chunk, refs in grid.candidate_blocks(pending):
            if refs.shape[1] < 3:
                failed.append(chunk)
                continue
            d2 = block_squared_distance(pxyz, cxyz, chunk, refs)
            local = refs - torch.div(chunk, n, rounding_mode="floor").unsqueeze(1) * m
            # Pads get distinct ids beyond every centre so the tie rule never prefers them.
            local = torch.where(refs >= 0, local, m + torch.arange(refs.shape[1], device=refs.device))
            vals, top = _three_smallest(d2, local)
            ok = vals[:, 2] < safe
            out_d[chunk[ok]] = vals[ok]
            out_i[chunk[ok]] = top[ok]
            failed.append(chunk[~ok])
        pending = torch.cat(failed) if failed else pending[:0]
        if pending.numel() == 0:
            return out_d, out_i
        cell *= 2.0
    if pending.numel():
        out_d[pending], out_i[pending] = _three_nn_dense(points, centers, pending)
    return out_d, out_i


def _compiled_unsuited(points: Tensor, centers: Tensor) -> str | None:
    if (
        points.device.type == "cpu"
        and centers.device.type == "cpu"
        and points.dtype in (torch.float32, torch.float64)
        and centers.dtype == points.dtype
        and bool(torch.isfinite(points).all())
        and bool(torch.isfinite(centers).all())
    ):
        return None
    return (
        "CPU float32/64 points and centres of one dtype and finite coordinates, "
        f"got {points.dtype} and {centers.dtype} on {points.device}"
    )


def _pick_method(points: Tensor, centers: Tensor, method: str, backend: str) -> tuple[str, ModuleType | None]:
    """The search that runs (``"dense"``, ``"grid"`` or ``"compiled"``) and the compiled module for the last."""
    expect_method("three_nearest_neighbors", method)
    backends.check_backend("three_nearest_neighbors", backend)
    if method != "auto":
        if backend == "compiled":
            raise ConfigError(
                f"three_nearest_neighbors: method={method!r} picks a torch search; "
                "use backend='plain' or 'auto' with it"
            )
        return method, None
    b, _, n = points.shape
    m = centers.shape[2]
    compiled = backends.choose("three_nn", backend, n, lambda: _compiled_unsuited(points, centers))
    if compiled is not None:
        return "compiled", compiled
    return ("grid" if m >= 3 and b * n * m >= (1 << 20) else "dense"), None


def _three_nn_cell(points: Tensor, centers: Tensor) -> float:
    """A cell side at which most points find their three nearest centres in the block:
    a high quantile of the third-neighbour distance of a small, evenly spread sample."""
    b, _, n = points.shape
    sample = torch.linspace(0, b * n - 1, min(b * n, 256), device=points.device).long()
    d, _ = _three_nn_dense(points, centers, sample)
    d3 = d[:, 2].double()
    d3 = d3[torch.isfinite(d3)]
    if d3.numel() == 0:
        return 1.0
    cell = math.sqrt(float(torch.quantile(d3, 0.9))) * 1.1
    span = float((centers.detach().amax(2) - centers.detach().amin(2)).max())
    return max(cell, span * 1e-4, 1e-12)


def three_nearest_neighbors(
    points_coords: Tensor, centers_coords: Tensor, method: str = "auto", backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """For each point, its three nearest centres: ``(indices [B, 3, N], weights [B, 3, N])``.

    Nearest by squared distance, ties to the lower index; with fewer than three centres the
    missing slots point at index 0 with distance 1e10. Weights are the inverse squared
    distances (distances clamped to [1e-10, 1e10]) normalised to sum 1, rounded as
    upstream's kernel rounds them.

    ``backend`` (:mod:`pointforge.nn.backends`): ``"compiled"`` is a grid search compiled
    with Numba (:mod:`.three_nn_compiled`; CPU float32/64 of finite coordinates), ``"plain"``
    the torch searches, ``"auto"`` the compiled search from its table's size up where it
    applies. ``method`` picks the torch search: ``"dense"`` (every pair, in chunks),
    ``"grid"`` (a cell grid, with cells sized from a sample of third-neighbour distances,
    falling back to the dense path for the points it cannot settle) or ``"auto"`` (the grid
    for large inputs, dense for small). All give the same indices and weights.
    """
    expect_coords("three_nearest_neighbors", "points_coords", points_coords)
    expect_coords("three_nearest_neighbors", "centers_coords", centers_coords, points_coords.shape[0])
    b, _, n = points_coords.shape
    m = centers_coords.shape[2]
    if m < 1:
        raise DataError("three_nearest_neighbors: centers_coords has no points; pass at least one centre")
    chosen, compiled = _pick_method(points_coords, centers_coords, method, backend)
    if compiled is not None:
        threads = torch.get_num_threads()
        found = compiled.three_nn_grid(points_coords.detach().numpy(), centers_coords.detach().numpy(), threads=threads)
        d, idx = (torch.from_numpy(a).view(-1, 3) for a in found)
    elif chosen == "grid" and m >= 3:
        d, idx = _three_nn_grid(points_coords, centers_coords, _three_nn_cell(points_coords, centers_coords))
    else:
        d, idx = _three_nn_dense(points_coords, centers_coords)
    idx, w = _finish_three_nn(d, idx)
    return idx.view(b, n, 3).transpose(1, 2).contiguous(), w.view(b, n, 3).transpose(1, 2).contiguous()


def interpolate_from_neighbors(centers_features: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
    """``sum_k weights[b, k, n] * centers_features[b, :, indices[b, k, n]]`` -> ``[B, C, N]``.

    Gradients reach ``centers_features`` only, as in upstream's kernel.
    """
    b, c, m = centers_features.shape
    rows = centers_features.transpose(1, 2).reshape(b * m, c).contiguous()
    return sum_bags(rows, *weighted_bags(indices, weights, m), b)


def three_nn_interpolate(points_coords: Tensor, centers_coords: Tensor, centers_features: Tensor) -> Tensor:
    """Features of the centres interpolated at the points (upstream ``nearest_neighbor_interpolate``)."""
    indices, weights = three_nearest_neighbors(points_coords, centers_coords)
    return interpolate_from_neighbors(centers_features, indices, weights)
