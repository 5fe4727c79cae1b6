"""Point-voxel operations of PVCNN2, in pure PyTorch, one operator per module.

Each operator computes what upstream's CUDA kernels (the ``_pvcnn_backend`` of PVD and
PCDiff) compute, including their tie rules and edge cases, so weights trained with those
kernels behave the same here, on CPU or on CUDA, with the same code: :mod:`.fps`,
:mod:`.ball_query`, :mod:`.grouping`, :mod:`.three_nn`, :mod:`.averaging` (points averaged into voxels),
:mod:`.devoxelize`; :mod:`.bags` is the weighted gather-sum behind the last two and the
3-NN interpolation, :mod:`.cell_grid` the candidate search behind ball query and 3-NN,
:mod:`.common` the checks and distance arithmetic they share.

Layouts follow upstream: coordinates ``[B, 3, N]`` with channel 0 = x, features
``[B, C, N]``. Indices are returned as int64.

The faster paths (a cell grid for ball query and 3-NN; on CPU a NumPy loop for FPS, and
:mod:`.fps_compiled`, a compiled one that skips the points a sample cannot reach) only
change *which* pairs are evaluated or by whom, never the arithmetic. Weighted sums of
features (interpolation, voxel means) equal the kernels' up to float rounding of the
summation order, as the kernels' own atomics do.

Gradients flow where upstream's ops have them: into features (gather, grouping, 3-NN
interpolation, averaging, devoxelisation) and, through gather and grouping, into
coordinates. Averaging, devoxelisation and 3-NN treat coordinates as constants, as
upstream does.
"""
