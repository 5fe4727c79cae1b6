"""PVCNN2's structure as plain data: :class:`PVCNN2Config`, its levels, and the presets.

The set-abstraction (SA) and feature-propagation (FP) levels are frozen dataclasses that
round-trip through plain dicts (YAML, checkpoints). :meth:`PVCNN2Config.from_upstream`
translates upstream's ``sa_blocks`` / ``fp_blocks`` into what upstream's builder actually
builds (see :mod:`pointforge.nn.pvcnn` for the quirks kept).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from pointforge.errors import ConfigError
from pointforge.nn.presets import preset

__all__ = [
    "GROUP_NORM_GROUPS",
    "PRESETS",
    "ConvStage",
    "FPLevel",
    "PVCNN2Config",
    "SALevel",
    "get_preset",
    "resolve_config",
]

GROUP_NORM_GROUPS = 8  # GroupNorm groups everywhere in upstream's PVCNN2


@dataclass(frozen=True)
class ConvStage:
    """``num_blocks`` PVConv blocks to ``out_channels`` on a ``voxel_resolution``³ grid
    (``voxel_resolution=None``: point-wise MLP blocks instead of PVConv)."""

    out_channels: int
    num_blocks: int
    voxel_resolution: int | None


@dataclass(frozen=True)
class SALevel:
    """A set-abstraction level: optional conv stage, then FPS to ``num_centers`` centres,
    ball query (``radius``, ``num_neighbors``) and a shared MLP max-pooled per centre."""

    conv: ConvStage | None
    num_centers: int
    radius: float
    num_neighbors: int
    mlp: tuple[int, ...]
    voxel_attention: bool = False  # attention in the first block of ``conv``


@dataclass(frozen=True)
class FPLevel:
    """A feature-propagation level: 3-NN interpolation + shared MLP, then a conv stage."""

    mlp: tuple[int, ...]
    conv: ConvStage | None


@dataclass(frozen=True)
class PVCNN2Config:
    """Everything that determines a PVCNN2's structure."""

    sa_levels: tuple[SALevel, ...]
    fp_levels: tuple[FPLevel, ...]
    embed_dim: int = 64
    global_attention: bool = True
    dropout: float = 0.1
    extra_feature_channels: int = 0
    num_classes: int = 3
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- upstream translation

    @classmethod
    def from_upstream(
        cls,
        sa_blocks: Sequence,
        fp_blocks: Sequence,
        *,
        embed_dim: int,
        use_att: bool,
        dropout: float = 0.1,
        extra_feature_channels: int = 0,
        num_classes: int = 3,
        width_multiplier: float = 1,
        voxel_resolution_multiplier: float = 1,
        description: str = "",
    ) -> "PVCNN2Config":
        """Translate upstream's class attributes ``sa_blocks`` / ``fp_blocks`` and its
        constructor arguments into the structure upstream actually builds."""
        r, vr = width_multiplier, voxel_resolution_multiplier

        def stage(conv: Sequence | None, first_level: bool) -> ConvStage | None:
            if conv is None:
                return None
            out, blocks, res = conv
            return ConvStage(
                int(r * out),
                int(blocks) if first_level else min(1, int(blocks)),
                None if res is None else int(vr * res),
            )

        sa = []
        for level, (conv, (centers, radius, neighbors, mlp)) in enumerate(sa_blocks):
            mlp = tuple(int(r * c) for c in (mlp if isinstance(mlp, (list, tuple)) else (mlp,)))
            sa.append(
                SALevel(
                    conv=stage(conv, level == 0),
                    num_centers=int(centers),
                    radius=float(radius),
                    num_neighbors=int(neighbors),
                    mlp=mlp,
                    voxel_attention=bool(use_att and level % 2 == 1 and conv is not None and conv[2] is not None),
                )
            )
        fp = []
        for mlp, conv in fp_blocks:
            mlp = tuple(int(r * c) for c in (mlp if isinstance(mlp, (list, tuple)) else (mlp,)))
            fp.append(FPLevel(mlp=mlp, conv=stage(conv, True)))
        return cls(
            sa_levels=tuple(sa),
            fp_levels=tuple(fp),
            embed_dim=int(embed_dim),
            global_attention=bool(use_att),
            dropout=float(dropout),
            extra_feature_channels=int(extra_feature_channels),
            num_classes=int(num_classes),
            description=description,
        )

    # ---- plain-data round trip (YAML, checkpoints)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PVCNN2Config":
        try:

            def conv(d: Mapping | None) -> ConvStage | None:
                return None if d is None else ConvStage(**d)

            sa = tuple(SALevel(**{**d, "conv": conv(d.get("conv")), "mlp": tuple(d["mlp"])}) for d in data["sa_levels"])
            fp = tuple(FPLevel(mlp=tuple(d["mlp"]), conv=conv(d.get("conv"))) for d in data["fp_levels"])
            rest = {k: v for k, v in data.items() if k not in ("sa_levels", "fp_levels")}
            return cls(sa_levels=sa, fp_levels=fp, **rest)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"PVCNN2 config is malformed ({exc}); start from a preset's to_dict() output") from None

    # ---- checks

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(f"PVCNN2 config: {message}")

        need(len(self.sa_levels) >= 1, "needs at least one SA level")
        need(
            len(self.fp_levels) == len(self.sa_levels),
            f"needs as many FP levels as SA levels, got {len(self.fp_levels)} and {len(self.sa_levels)}",
        )
        need(self.sa_levels[0].conv is not None, "the first SA level needs a conv stage (upstream's layout)")
        need(self.embed_dim >= 2, f"embed_dim must be at least 2, got {self.embed_dim}")
        need(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        need(
            self.extra_feature_channels >= 0 and self.num_classes >= 1,
            "extra_feature_channels must be >= 0 and num_classes >= 1",
        )

        def groups_ok(c: int, where: str) -> None:
            need(
                c >= GROUP_NORM_GROUPS and c % GROUP_NORM_GROUPS == 0,
                f"{where} has {c} channels; GroupNorm(8) needs a positive multiple of 8",
            )

        for i, level in enumerate(self.sa_levels):
            need(
                level.num_centers >= 1 and level.num_neighbors >= 1 and level.radius > 0,
                f"SA level {i} needs num_centers, num_neighbors >= 1 and radius > 0",
            )
            need(len(level.mlp) >= 1, f"SA level {i} needs at least one MLP layer")
            for c in level.mlp:
                groups_ok(c, f"SA level {i} MLP")
            if level.conv is not None:
                groups_ok(level.conv.out_channels, f"SA level {i} conv")
                need(level.conv.num_blocks >= 1, f"SA level {i} conv needs at least one block")
                need(
                    i == 0 or level.conv.num_blocks == 1,
                    f"SA level {i} conv: upstream builds one block in SA levels after the first; use num_blocks=1",
                )
            need(
                not level.voxel_attention or (level.conv is not None and level.conv.voxel_resolution is not None),
                f"SA level {i}: voxel_attention needs a PVConv stage",
            )
        for i, fp_level in enumerate(self.fp_levels):
            need(len(fp_level.mlp) >= 1, f"FP level {i} needs at least one MLP layer")
            for c in fp_level.mlp:
                groups_ok(c, f"FP level {i} MLP")
            if fp_level.conv is not None:
                groups_ok(fp_level.conv.out_channels, f"FP level {i} conv")
                need(fp_level.conv.num_blocks >= 1, f"FP level {i} conv needs at least one block")
        if self.global_attention:
            groups_ok(_sa_out_channels(self.sa_levels[-1]), "the global attention (last SA level output)")

    @property
    def min_points(self) -> int:
        """The fewest input points the network accepts (FPS cannot pick more centres than points)."""
        return self.sa_levels[0].num_centers


def _sa_out_channels(level: SALevel) -> int:
    return level.mlp[-1]


# =========================================================================== presets


def _paper() -> PVCNN2Config:
    return PVCNN2Config.from_upstream(
        sa_blocks=[
            ((32, 2, 32), (10240, 0.1, 128, (32, 64))),
            ((64, 3, 16), (2560, 0.2, 128, (64, 128))),
            ((128, 3, 8), (640, 0.4, 128, (128, 256))),
            (None, (160, 0.8, 128, (256, 256, 512))),
        ],
        fp_blocks=[
            ((256, 256), (256, 3, 8)),
            ((256, 256), (256, 3, 8)),
            ((256, 128), (128, 2, 16)),
            ((128, 128, 64), (64, 2, 32)),
        ],
        embed_dim=64,
        use_att=True,
        dropout=0.1,
        extra_feature_channels=0,
        description="PCDiff paper network (27.6 M parameters), for 30,720 points (27,648 skull + 3,072 implant); GPU.",
    )


def _small() -> PVCNN2Config:
    # The paper's layout for 1/8 of the points: centres / 8, radii x sqrt(8) (surface
    # density / 8), channels and voxel resolutions halved, 32 neighbour slots (the paper's
    # balls hold ~5-10 points in 128 slots). 6.9 M parameters.
    return PVCNN2Config.from_upstream(
        sa_blocks=[
            ((16, 2, 16), (1280, 0.3, 32, (16, 32))),
            ((32, 3, 8), (320, 0.6, 32, (32, 64))),
            ((64, 3, 4), (80, 1.2, 32, (64, 128))),
            (None, (20, 2.4, 32, (128, 128, 256))),
        ],
        fp_blocks=[
            ((128, 128), (128, 3, 4)),
            ((128, 128), (128, 3, 4)),
            ((128, 64), (64, 2, 8)),
            ((64, 64, 32), (32, 2, 16)),
        ],
        embed_dim=32,
        use_att=True,
        dropout=0.1,
        extra_feature_channels=0,
        description="CPU training in minutes: 3,840 points (3,456 skull + 384 implant).",
    )


def _tiny() -> PVCNN2Config:
    # Exactly the network of the upstream reference fixture (upstream_pvcnn2_tiny.pt), so
    # the preset itself is checked against upstream's output.
    return PVCNN2Config.from_upstream(
        sa_blocks=[
            ((8, 2, 16), (256, 0.1, 16, (8, 16))),
            ((16, 3, 8), (64, 0.2, 16, (16, 32))),
            ((32, 3, 4), (16, 0.4, 16, (32, 64))),
            (None, (8, 0.8, 16, (64, 64, 128))),
        ],
        fp_blocks=[
            ((32, 32), (32, 3, 4)),
            ((32, 32), (32, 3, 4)),
            ((32, 16), (16, 2, 8)),
            ((16, 16, 8), (8, 2, 16)),
        ],
        embed_dim=32,
        use_att=True,
        dropout=0.1,
        extra_feature_channels=0,
        description="CI and smoke tests in seconds: 1,024 points (896 skull + 128 implant).",
    )


PRESETS: dict[str, Any] = {"paper": _paper, "small": _small, "tiny": _tiny}


def get_preset(name: str) -> PVCNN2Config:
    """The named preset's configuration (``paper``, ``small`` or ``tiny``)."""
    return preset("PVCNN2", PRESETS, name)


def resolve_config(config: PVCNN2Config | str | Mapping) -> PVCNN2Config:
    """A preset name, a config or its ``to_dict()`` form -> :class:`PVCNN2Config`."""
    if isinstance(config, PVCNN2Config):
        return config
    if isinstance(config, str):
        return get_preset(config)
    if isinstance(config, Mapping):
        return PVCNN2Config.from_dict(config)
    raise ConfigError(f"PVCNN2 config must be a preset name, a PVCNN2Config or a dict, got {type(config).__name__}")
