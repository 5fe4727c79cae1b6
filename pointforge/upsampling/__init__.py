"""The upsampling product: densify sparse point clouds (airborne lidar) with a trained upsampler.

``pipeline`` (points and files through the network, tiled when large),
``tiling`` (seamless overlapping tiles), ``metrics`` (Chamfer, Hausdorff,
point-to-surface, uniformity), ``baselines`` (what the network must beat) and
``evaluate`` (a folder of predictions against a folder of truths). May import
``inference`` and every layer below it; ``implant`` builds on it.
"""
