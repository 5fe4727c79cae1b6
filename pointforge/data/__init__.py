"""Data in and out: volumes (NRRD, NIfTI), surfaces and point sampling, skull datasets and splits, lidar pairs and point files, batching.

May import only the ground floor (errors, atomic, devices, formats, config)
and the networks' numerical helpers in ``nn`` (k-NN).
"""
