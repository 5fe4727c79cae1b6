"""The table of compiled paths: what it lists, the one ``backend`` keyword, the environment switch, lazy imports."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import pytest
import torch
from torch import nn

from pointforge.errors import ConfigError, DataError
from pointforge.nn import backends, dpsr as dpsr_module, fused_norm
from pointforge.nn.dpsr import DPSR, dpsr
from pointforge.nn.pvops import fps, three_nn
from pointforge.nn.pvops.fps import furthest_point_sample_indices
from pointforge.nn.pvops.three_nn import three_nearest_neighbors
from tests.helpers import subprocess_env

COMPILED_PACKAGES = ("numba", "ducc0")


@pytest.fixture
def fake_path(monkeypatch):
    """A row named "fake" whose "compiled module" is json (importable, no compilation), from 10 items."""

    def install(packages=("json",)):
        monkeypatch.setitem(backends.PATHS, "fake", backends.CompiledPath("fake op", "json", packages, 10, "items"))
        backends.load.cache_clear()

    yield install
    backends.load.cache_clear()


def _never() -> str | None:
    raise AssertionError("the inputs need no look when the answer is already known")


def _thresholds_at_zero(monkeypatch) -> None:
    """Every row taken by "auto" from size 0, so only the environment switch can keep it away."""
    for name, path in list(backends.PATHS.items()):
        monkeypatch.setitem(backends.PATHS, name, dataclasses.replace(path, min_size=0))


# ----------------------------------------------------------------------------- the table


def test_every_row_names_a_module_and_packages_that_exist():
    assert set(backends.PATHS) == {"fps", "three_nn", "fused_norm", "dpsr"}
    for name, path in backends.PATHS.items():
        assert importlib.util.find_spec(path.module) is not None, f"{name}: no module {path.module}"
        assert set(path.packages) <= set(COMPILED_PACKAGES), name
        assert path.min_size >= 0 and path.unit
    assert backends.PATHS["dpsr"].packages == ("ducc0", "numba")  # the FFT library and the pruned solve: one choice


def test_available_follows_the_installed_packages(fake_path):
    for name, path in backends.PATHS.items():
        assert backends.available(name) == all(importlib.util.find_spec(p) is not None for p in path.packages)
    fake_path(("json", "no_such_package_pointforge"))
    assert not backends.available("fake")
    assert backends.load("fake") is None


@pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in COMPILED_PACKAGES), reason="needs Numba and ducc0 installed"
)
def test_every_compiled_module_loads_where_its_packages_are_installed():
    for name, path in backends.PATHS.items():
        module = backends.load(name)
        assert module is not None and module.__name__ == path.module


# ----------------------------------------------------------------------------- choose


def test_choose_auto_takes_the_compiled_path_from_the_rows_size_where_it_suits(fake_path):
    fake_path()
    assert backends.choose("fake", "auto", 9, _never) is None
    assert backends.choose("fake", "auto", 10, lambda: None).__name__ == "json"
    assert backends.choose("fake", "auto", 10, lambda: "CPU tensors") is None
    assert backends.choose("fake", "plain", 10**9, _never) is None


def test_choose_compiled_ignores_the_size_and_says_why_it_cannot_run(fake_path):
    fake_path()
    assert backends.choose("fake", "compiled", 1, lambda: None).__name__ == "json"
    with pytest.raises(DataError, match="fake op: backend='compiled' needs CPU tensors; use backend='auto'"):
        backends.choose("fake", "compiled", 1, lambda: "CPU tensors")
    fake_path(("json", "no_such_package_pointforge"))
    assert backends.choose("fake", "auto", 10, lambda: None) is None
    with pytest.raises(ConfigError, match="pip install json no_such_package_pointforge"):
        backends.choose("fake", "compiled", 10, lambda: None)
    with pytest.raises(ConfigError, match="backend must be one of auto, plain, compiled, got 'numba'"):
        backends.choose("fake", "numba", 10, _never)


# ----------------------------------------------------------------------------- one keyword, every op


def _features() -> tuple[torch.Tensor, nn.GroupNorm]:
    return torch.randn(1, 8, 64), nn.GroupNorm(8, 8).requires_grad_(False)


# Each op with a compiled variant, called with a given backend on small CPU inputs.
OPS = {
    "fps": lambda backend: furthest_point_sample_indices(torch.rand(1, 3, 40), 5, backend=backend),
    "three_nn": lambda backend: three_nearest_neighbors(torch.rand(1, 3, 40), torch.rand(1, 3, 9), backend=backend),
    "dpsr": lambda backend: dpsr(torch.rand(1, 30, 3) * 0.9, torch.randn(1, 30, 3), 8, backend=backend),
    "DPSR": lambda backend: DPSR(8, backend=backend),
    "fused_norm": lambda backend: fused_norm.applies(*_features(), backend=backend),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_takes_the_same_keyword_and_values(op):
    for backend in ("plain", "auto"):
        OPS[op](backend)
    with pytest.raises(ConfigError, match="backend must be one of auto, plain, compiled, got 'torch'"):
        OPS[op]("torch")


def test_plain_never_loads_and_compiled_always_loads_the_compiled_module(monkeypatch):
    loaded: list[str] = []
    load = backends.load

    def recording(name: str):
        loaded.append(name)
        return load(name)

    monkeypatch.setattr(backends, "load", recording)
    with torch.no_grad():
        for op in ("fps", "three_nn", "dpsr", "fused_norm"):
            OPS[op]("plain")
        assert loaded == []
        if all(backends.available(name) for name in backends.PATHS):
            assert fused_norm.applies(*_features(), backend="compiled")  # an explicit choice ignores the size
            for op in ("fps", "three_nn", "dpsr"):
                OPS[op]("compiled")
            assert loaded == ["fused_norm", "fps", "three_nn", "dpsr"]


def test_compiled_on_inputs_it_does_not_read_is_one_clear_error():
    x, norm = _features()
    with torch.no_grad(), pytest.raises(DataError, match="fused GroupNorm: backend='compiled' needs CPU float32"):
        fused_norm.applies(x.double(), norm, backend="compiled")
    with pytest.raises(DataError, match="furthest_point_sample: backend='compiled' needs a CPU float32/64"):
        furthest_point_sample_indices(torch.rand(1, 3, 40).half(), 5, backend="compiled")


def test_tensors_off_the_cpu_take_the_plain_path(monkeypatch):
    """What CUDA tensors get, shown on the meta device (no data): "auto" never picks a compiled path for them."""
    _thresholds_at_zero(monkeypatch)
    points = torch.empty(1, 3, 40, device="meta")
    assert fps._pick_loop(points, "auto", "auto") == ("torch", None)
    assert three_nn._pick_method(points, points[:, :, :9], "auto", "auto") == ("dense", None)
    assert backends.choose("dpsr", "auto", 8**3, lambda: dpsr_module._compiled_unsuited(points.device)) is None
    with pytest.raises(DataError, match="DPSR: backend='compiled' needs CPU tensors, got them on meta"):
        backends.choose("dpsr", "compiled", 8**3, lambda: dpsr_module._compiled_unsuited(points.device))


# ----------------------------------------------------------------------------- the environment switch


def test_environment_switch_turns_every_auto_into_plain(monkeypatch):
    _thresholds_at_zero(monkeypatch)
    points, centers = torch.rand(1, 3, 40), torch.rand(1, 3, 9)
    x, norm = _features()
    monkeypatch.setenv(backends.ENV_VAR, "plain")
    assert backends.forced_plain()
    assert fps._pick_loop(points, "auto", "auto")[0] == "numpy"
    assert three_nn._pick_method(points, centers, "auto", "auto")[0] == "dense"
    with torch.no_grad():
        assert not fused_norm.applies(x, norm)
    assert backends.choose("dpsr", "auto", 8**3, _never) is None
    if backends.available("fps"):  # an explicit choice is still honoured
        assert fps._pick_loop(points, "auto", "compiled")[0] == "compiled"
    monkeypatch.setenv(backends.ENV_VAR, "auto")
    assert not backends.forced_plain()
    if backends.available("fps"):
        assert fps._pick_loop(points, "auto", "auto")[0] == "compiled"
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    with pytest.raises(ConfigError, match="POINTFORGE_BACKEND='torch' is not understood"):
        fps._pick_loop(points, "auto", "auto")


def _child(code: str, **env: str) -> list[str]:
    """The compiled paths' packages a fresh interpreter has imported after running ``code``."""
    probe = f"{code}\nimport sys\nprint(' '.join(p for p in {COMPILED_PACKAGES!r} if p in sys.modules))"
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env={**subprocess_env(), **env}
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_importing_the_product_loads_neither_numba_nor_ducc0():
    assert _child("import pointforge.implant.pipeline, pointforge.cli.main, pointforge.nn.backends") == []


def test_environment_switch_keeps_numba_and_ducc0_out_of_a_run_that_would_load_them():
    # Sizes above every row's threshold on CPU: "auto" would take all four compiled paths.
    code = (
        "import torch\n"
        "from pointforge.nn import backends, fused_norm\n"
        "from pointforge.nn.dpsr import dpsr\n"
        "from pointforge.nn.pvops.fps import furthest_point_sample_indices\n"
        "from pointforge.nn.pvops.three_nn import three_nearest_neighbors\n"
        "p = torch.rand(1, 3, 8192)\n"
        "furthest_point_sample_indices(p, 4)\n"
        "three_nearest_neighbors(p, p[:, :, :64].contiguous())\n"
        "dpsr(torch.rand(1, 50, 3) * 0.9, torch.randn(1, 50, 3), 8)\n"
        "with torch.no_grad():\n"
        "    assert not fused_norm.applies(torch.randn(1, 8, 1 << 16), torch.nn.GroupNorm(8, 8))\n"
    )
    assert _child(code, **{backends.ENV_VAR: "plain"}) == []
