"""Skull datasets: raw layouts, seeded splits grouped by skull, prepared folders and the training Datasets.

* :mod:`~pointforge.data.skulls.layouts`: SkullBreak / SkullFix folders, one case per defective skull;
* :mod:`~pointforge.data.skulls.splits`: seeded splits grouped by skull;
* :mod:`~pointforge.data.skulls.cutting`: the five SkullBreak defect classes cut from a folder's complete skulls;
* :mod:`~pointforge.data.skulls.prepared`: a prepared folder's index and files;
* :mod:`~pointforge.data.skulls.normalization`: points to the networks' frame and back;
* :mod:`~pointforge.data.skulls.grids`: the voxelizer's target grids;
* :mod:`~pointforge.data.skulls.datasets`: ``CompletionDataset`` and ``VoxelizationDataset``.
"""
