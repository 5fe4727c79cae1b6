"""PVCNN2 roofline: every op's seconds, work and fraction of this machine's peak, forward and backward.

For the paper preset (30,720 points: 27,648 skull + 3,072 implant, bench/pvcnn.py's
synthetic skull) and the tiny preset (the demo recipe's 1,536 + 256 points), at the
batch sizes asked for, one process:

* the machine's peaks, measured first in the same process and thread count: a large
  matrix product (GFLOP/s), a large 3x3x3 convolution through the same call the network
  uses (GFLOP/s), and a large copy (GB/s moved);
* an evaluation forward (no grad, as sampling runs it) and a training forward + backward,
  each op category timed exclusively: forward by wrapping the functions the network
  calls plus a torch-function mode that labels GroupNorm, SiLU and matrix products by
  what they are; backward by timing every autograd node, each attributed to the category
  whose forward call created it.

Work per category: FLOPs of the matrix products and convolutions (counted from shapes),
bytes read and written by the other ops (each call's tensor inputs and outputs, views
excluded: a lower bound on traffic), furthest point sampling as the plain loop's distance
arithmetic (8 FLOPs per point per sample). Backward work is taken as twice the forward's
(two products per product; the estimate is marked). The fraction of peak is the roofline
one: achieved rate over min(compute peak, arithmetic intensity x copy bandwidth); the
convolutions are held to the conv peak, everything else to the matrix-product peak.

The forward's floor sums every category at its roofline (its counted work at the peak
that holds it, the index searches with no work model at their measured time): the least
time the network as written, one pass per op, could take on this machine.

Instrumentation costs a few microseconds per call; the un-instrumented totals are printed
beside the sums. ``--device cuda`` synchronises around every timed region (serialising
the GPU: honest attribution, not the fastest run); ``--bf16`` runs under autocast. On CPU
the process keeps freed memory in its heap (``devices.reuse_freed_memory``), as every CPU
sampling process does; batches run whole (no evaluation chunks).

    python bench/pvcnn_roofline.py [--device cpu] [--bf16] [--threads 2]
        [--paper-batches 1 5] [--tiny-batches 1 5 8] [--skip-backward]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from pvcnn import synthetic_skull
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily

from _common import machine, print_table, record_header, write_json
from pointforge.devices import reuse_freed_memory
from pointforge.nn import pvcnn_blocks
from pointforge.nn.pvcnn import PVCNN2
from pointforge.nn.pvops import ball_query, fps, three_nn

SIZES = {"paper": (27_648, 3_072), "tiny": (1_536, 256)}
T_STEP = 500
OTHER = "other (embedding, concat, dropout, glue)"
CONV = "3-D convolutions"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_peaks(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """GFLOP/s of a large matrix product and a large 3x3x3 convolution, GB/s of a large copy."""
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul = 2 * n**3 / _best_seconds(lambda: a @ b, device, 5) / 1e9
    side, channels = (32, 64) if device.type == "cpu" else (64, 128)
    conv = nn.Conv3d(channels, channels, 3, padding=1).to(device, dtype)
    grid = torch.randn(2, channels, side, side, side, device=device, dtype=dtype)
    with torch.no_grad():
        seconds = _best_seconds(lambda: pvcnn_blocks._conv3d(conv, grid), device, 3)
    conv_flops = 2 * grid.numel() * channels * 27 / seconds / 1e9
    src = torch.randn(64 * 2**20, device=device)
    dst = torch.empty_like(src)
    copy = 2 * src.nbytes / _best_seconds(lambda: dst.copy_(src), device, 5) / 1e9
    return {"matmul_gflops": matmul, "conv3d_gflops": conv_flops, "copy_gbs": copy}


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _product_flops(func: Any, args: tuple, out: Any) -> float:
    """FLOPs of a matrix product call, from its shapes (0 for anything else)."""
    if func in (torch.addmm, torch.baddbmm, torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, torch.mm):
        a = args[1] if func in (torch.addmm, torch.baddbmm) else args[0]
        return 2.0 * out.numel() * a.shape[-1]
    if func is F.linear:
        return 2.0 * out.numel() * args[0].shape[-1]
    if func is F.scaled_dot_product_attention:
        q, k = args[0], args[1]
        return 4.0 * q.numel() * k.shape[-2]
    return 0.0


class Attribution(TorchFunctionMode):
    """Exclusive seconds, FLOPs and bytes per op category, and the category of every autograd node."""

    RULES = {F.group_norm: "GroupNorm", F.silu: "SiLU"}

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.stack: list[list[Any]] = []  # [label, start, seconds spent in nested labels]
        self.seconds: dict[str, float] = {}
        self.flops: dict[str, float] = {}
        self.bytes: dict[str, float] = {}
        self.node_label: dict[Any, str] = {}

    def label(self) -> str:
        return self.stack[-1][0] if self.stack else OTHER

    def enter(self, label: str) -> None:
        _sync(self.device)
        self.stack.append([label, time.perf_counter(), 0.0])

    def leave(self) -> None:
        _sync(self.device)
        label, start, nested = self.stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[label] = self.seconds.get(label, 0.0) + elapsed - nested
        if self.stack:
            self.stack[-1][2] += elapsed

    def add(self, label: str, flops: float = 0.0, nbytes: float = 0.0) -> None:
        self.flops[label] = self.flops.get(label, 0.0) + flops
        self.bytes[label] = self.bytes.get(label, 0.0) + nbytes

    def mark_nodes(self, outputs: Any, label: str) -> None:
        """Give every autograd node behind ``outputs`` not yet labelled this label (it was made here)."""
        stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in self.node_label:
                continue
            self.node_label[node] = label
            stack.extend(child for child, _ in node.next_functions)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        rule = self.RULES.get(func)
        if rule is None and func is torch.addmm and self.label().startswith("grouping"):
            rule = "point MLPs"  # the SA levels' shared MLP runs inline
        if rule is not None:
            self.enter(rule)
        try:
            out = func(*args, **kwargs)
        finally:
            if rule is not None:
                self.leave()
        label = rule or self.label()
        inputs = list(_tensors((args, kwargs)))
        moved = sum(t.nbytes for t in inputs if t.device.type != "meta")
        shares = any(o._is_view() for o in _tensors(out))
        if not shares:
            moved += sum(o.nbytes for o in _tensors(out))
        self.add(label, _product_flops(func, args, out), 0.0 if shares else float(moved))
        self.mark_nodes(out, label)
        return out


def _conv_flops(args: tuple, out: Tensor) -> tuple[float, float]:
    conv = args[0]
    return 2.0 * out.numel() * conv.in_channels * 27, 0.0


def _fps_flops(args: tuple, out: Any) -> tuple[float, float]:
    coords, samples = args[0], int(args[1])
    return 8.0 * coords.shape[0] * coords.shape[2] * samples, 0.0


# (owner, attribute, category, leaf: run without the mode, work from (args, result))
PATCHES: list[tuple[Any, str, str, bool, Callable[[tuple, Any], tuple[float, float]] | None]] = [
    (fps, "furthest_point_sample", "FPS", True, _fps_flops),
    (ball_query, "ball_query", "ball query", True, None),
    (three_nn, "three_nearest_neighbors", "3-NN search", True, None),
    (three_nn, "interpolate_from_neighbors", "3-NN interpolation", False, None),
    (pvcnn_blocks.SetAbstraction, "_pool_distinct", "grouping + max-pool", False, None),
    (pvcnn_blocks, "_segment_group_norm", "GroupNorm", False, None),
    (pvcnn_blocks.VoxelMap, "__init__", "voxel maps (coordinates, corners)", False, None),
    (pvcnn_blocks.VoxelMap, "average", "voxel averaging", False, None),
    (pvcnn_blocks.VoxelMap, "devoxelize", "devoxelize", False, None),
    (pvcnn_blocks, "_conv3d", CONV, False, _conv_flops),
    (pvcnn_blocks.Attention, "forward", "attention", False, None),
    (pvcnn_blocks.SqueezeExcite3d, "forward", "squeeze-excite", False, None),
    (pvcnn_blocks, "pointwise", "point MLPs", False, None),
]


@contextlib.contextmanager
def instrumented(device: torch.device) -> Iterator[Attribution]:
    """Patch the network's op functions to report to one :class:`Attribution`; undo on exit."""
    attribution = Attribution(device)
    undo: list[Callable[[], None]] = []
    for owner, attr, label, leaf, work in PATCHES:
        original = getattr(owner, attr)

        def timed(*args: Any, _original: Any = original, _label: str = label, _leaf: bool = leaf, _work: Any = work):
            attribution.enter(_label)
            try:
                with _pop_mode_temporarily() if _leaf else contextlib.nullcontext():
                    out = _original(*args)
            finally:
                attribution.leave()
            if _work is not None:
                attribution.add(_label, *_work(args, out))
            attribution.mark_nodes(out, _label)
            return out

        setattr(owner, attr, functools.wraps(original)(timed))
        undo.append(functools.partial(setattr, owner, attr, original))
    try:
        with attribution:
            attribution.enter(OTHER)  # the network's own code between the ops
            yield attribution
            attribution.leave()
    finally:
        for step in reversed(undo):
            step()


def timed_backward(loss: Tensor, labels: dict[Any, str], device: torch.device) -> tuple[dict[str, float], float]:
    """Backward of ``loss`` with every autograd node timed; seconds per category and in all."""
    seconds: dict[str, float] = {}
    started: dict[Any, float] = {}
    handles = []
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        label = labels.get(node, OTHER)

        def pre(grad_outputs: Any, _node: Any = node) -> None:
            _sync(device)
            started[_node] = time.perf_counter()

        def post(grad_inputs: Any, grad_outputs: Any, _node: Any = node, _label: str = label) -> None:
            _sync(device)
            seconds[_label] = seconds.get(_label, 0.0) + time.perf_counter() - started.pop(_node)

        handles += [node.register_prehook(pre), node.register_hook(post)]
        stack.extend(child for child, _ in node.next_functions)
    _sync(device)
    start = time.perf_counter()
    loss.backward()
    _sync(device)
    total = time.perf_counter() - start
    for handle in handles:
        handle.remove()
    return seconds, total


# --------------------------------------------------------------------------- one configuration


def _inputs(preset: str, batch: int, device: torch.device) -> tuple[Tensor, Tensor, int]:
    conditioning, generated = SIZES[preset]
    x = torch.cat([synthetic_skull(seed, conditioning, generated) for seed in range(batch)]).to(device)
    return x, torch.full((batch,), T_STEP, device=device), generated


def _autocast(device: torch.device, bf16: bool) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def run_case(preset: str, batch: int, device: torch.device, bf16: bool, backward: bool) -> dict[str, Any]:
    """Un-instrumented totals, then the instrumented evaluation forward and training step."""
    torch.manual_seed(0)
    model = PVCNN2(preset).to(device)
    x, t, generated = _inputs(preset, batch, device)
    record: dict[str, Any] = {"preset": preset, "batch": batch, "points": x.shape[2]}
    with torch.no_grad(), _autocast(device, bf16):
        model.eval()
        record["forward_s"] = _best_seconds(lambda: model(x, t), device, 1)
        with instrumented(device) as eval_run:
            record["forward_instrumented_s"] = _once(lambda: model(x, t), device)
    record["forward"] = {"seconds": eval_run.seconds, "flops": eval_run.flops, "bytes": eval_run.bytes}
    if not backward:
        return record
    model.train()

    def loss_of() -> Tensor:
        with _autocast(device, bf16):
            y = model(x, t)
        return (y[:, :, -generated:].float() ** 2).mean()

    record["train_step_s"] = _best_seconds(lambda: loss_of().backward(), device, 1)
    model.zero_grad(set_to_none=True)
    with instrumented(device) as train_run:
        loss = loss_of()
    seconds, total = timed_backward(loss, train_run.node_label, device)
    record["backward_instrumented_s"] = total
    # Backward work: two products per forward product, and as much traffic again (an estimate).
    record["backward"] = {
        "seconds": seconds,
        "flops": {k: 2 * v for k, v in train_run.flops.items()},
        "bytes": {k: 2 * v for k, v in train_run.bytes.items()},
        "work_estimated": True,
    }
    return record


def _once(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


# --------------------------------------------------------------------------- report


def roof_fraction(seconds: float, flops: float, nbytes: float, compute_peak: float, bandwidth: float) -> float:
    """Achieved rate over the roofline's attainable rate (peaks in GFLOP/s and GB/s)."""
    if seconds <= 0 or (flops <= 0 and nbytes <= 0):
        return float("nan")
    if flops > 0:
        attainable = compute_peak if nbytes <= 0 else min(compute_peak, flops / nbytes * bandwidth)
        return flops / seconds / 1e9 / attainable
    return nbytes / seconds / 1e9 / bandwidth


def floor_seconds(flops: float, nbytes: float, compute_peak: float, bandwidth: float) -> float:
    """The roofline's least time for this work: max(FLOPs at the compute peak, bytes at the bandwidth)."""
    return max(flops / compute_peak, nbytes / bandwidth) / 1e9


def forward_floor(record: dict[str, Any], peaks: dict[str, float]) -> dict[str, Any]:
    """The evaluation forward's floor: every category at its roofline, summed.

    Categories with counted work (FLOPs or bytes) contribute their floor; the index searches
    with no work model (ball query, 3-NN search) contribute their measured seconds, listed
    apart. ``floor_s`` is a floor for the network as written (each op a separate pass, as
    eager PyTorch runs it), not for a fused one.
    """
    fwd = record["forward"]
    floors, uncounted = {}, {}
    for label, seconds in fwd["seconds"].items():
        flops, nbytes = fwd["flops"].get(label, 0.0), fwd["bytes"].get(label, 0.0)
        if flops <= 0 and nbytes <= 0:
            uncounted[label] = seconds
            continue
        peak = peaks["conv3d_gflops"] if label == CONV else peaks["matmul_gflops"]
        floors[label] = floor_seconds(flops, nbytes, peak, peaks["copy_gbs"])
    floor = sum(floors.values()) + sum(uncounted.values())
    return {
        "floor_s": floor,
        "counted_floor_s": floors,
        "uncounted_measured_s": uncounted,
        "forward_over_floor": record["forward_s"] / floor,
    }


def case_rows(record: dict[str, Any], peaks: dict[str, float]) -> list[list[Any]]:
    fwd, bwd = record["forward"], record.get("backward", {"seconds": {}, "flops": {}, "bytes": {}})
    labels = sorted(
        set(fwd["seconds"]) | set(bwd["seconds"]),
        key=lambda k: -(fwd["seconds"].get(k, 0.0) + bwd["seconds"].get(k, 0.0)),
    )
    rows = []
    for label in labels:
        peak = peaks["conv3d_gflops"] if label == CONV else peaks["matmul_gflops"]
        row: list[Any] = [label]
        for part in (fwd, bwd):
            s, f, m = (part[key].get(label, 0.0) for key in ("seconds", "flops", "bytes"))
            row += [s, f / 1e9, m / 1e6, 100 * roof_fraction(s, f, m, peak, peaks["copy_gbs"])]
        rows.append(row)
    return rows


def print_case(record: dict[str, Any], peaks: dict[str, float]) -> None:
    fwd_sum = sum(record["forward"]["seconds"].values())
    title = (
        f"{record['preset']}, batch {record['batch']}, {record['points']:,} points: forward {record['forward_s']:.3f} s"
    )
    title += f" un-instrumented, {record['forward_instrumented_s']:.3f} s instrumented (categories sum {fwd_sum:.3f})"
    if "backward" in record:
        title += f"; train step {record['train_step_s']:.3f} s, backward {record['backward_instrumented_s']:.3f} s"
        title += f" instrumented (nodes sum {sum(record['backward']['seconds'].values()):.3f})"
    print(title)
    headers = ["op", "fwd s", "fwd GFLOP", "fwd MB", "fwd % roof", "bwd s", "bwd GFLOP*", "bwd MB*", "bwd % roof"]
    print_table(headers, case_rows(record, peaks))
    floor = record["forward_floor"]
    searches = ", ".join(f"{k} {v:.3f} s" for k, v in floor["uncounted_measured_s"].items())
    print(
        f"forward floor {floor['floor_s']:.3f} s: every counted op at its roofline "
        f"({CONV} {floor['counted_floor_s'].get(CONV, 0.0):.3f} s of it), plus the searches as measured "
        f"({searches}); the un-instrumented forward is {floor['forward_over_floor']:.2f}x the floor"
    )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--bf16", action="store_true", help="run under bfloat16 autocast (peaks in bfloat16 too)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paper-batches", type=int, nargs="*", default=[1, 5], help="add 8 for the paper's batch 8")
    parser.add_argument("--tiny-batches", type=int, nargs="*", default=[1, 5, 8])
    parser.add_argument("--skip-backward", action="store_true")
    parser.add_argument("--name", default="pvcnn_roofline", help="results file bench/results/NAME.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/pvcnn_roofline.py: --device cuda asked for, but CUDA is not available here")
    torch.set_num_threads(args.threads)
    if device.type == "cpu":
        reuse_freed_memory()  # as every CPU sampling process runs (inference.load_pcdiff)
    load_before = os.getloadavg()
    peaks = measure_peaks(device, torch.bfloat16 if args.bf16 else torch.float32)
    print(machine(), f"| {args.device}, {args.threads} threads, {'bf16 autocast' if args.bf16 else 'float32'}")
    print(
        f"peaks: matrix product {peaks['matmul_gflops']:.1f} GFLOP/s, 3x3x3 convolution "
        f"{peaks['conv3d_gflops']:.1f} GFLOP/s, copy {peaks['copy_gbs']:.1f} GB/s "
        f"(load average {load_before[0]:.1f})\n"
    )
    cases = [("paper", b) for b in args.paper_batches] + [("tiny", b) for b in args.tiny_batches]
    records = []
    for preset, batch in cases:
        records.append(run_case(preset, batch, device, args.bf16, not args.skip_backward))
        records[-1]["forward_floor"] = forward_floor(records[-1], peaks)
        print_case(records[-1], peaks)
    print("* backward work is estimated as twice the forward's; % roof = achieved / min(peak, intensity x bandwidth)")
    load_after = os.getloadavg()
    print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cores")
    load = {"before": load_before, "after": load_after}
    record = record_header("pvcnn_roofline", device=args.device, bf16=args.bf16, threads=args.threads, load=load)
    record.update(peaks=peaks, cases=records)
    print(f"wrote {write_json(args.name, record)}")


if __name__ == "__main__":
    main()
