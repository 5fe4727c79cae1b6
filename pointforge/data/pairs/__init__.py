"""Sparse/dense point cloud pairs of any size, for training the upsampler.

* :mod:`~pointforge.data.pairs.manifest`: the CSV/JSON manifests that list pairs;
* :mod:`~pointforge.data.pairs.normalization`: one centre and scale per pair, from the sparse cloud;
* :mod:`~pointforge.data.pairs.dataset`: ``UpsamplingPairs``, with the sparse kNN graph cached;
* :mod:`~pointforge.data.pairs.scenes`: synthetic airborne-lidar pairs.
"""
