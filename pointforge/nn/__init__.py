"""The networks and their numerical parts: PVCNN2 and its point-voxel ops, the diffusion, DPSR, the voxelizer, the upsampler.

Pure PyTorch, the same code on CPU and CUDA. Networks know nothing about ranks,
datasets or files; they may import only the ground floor (errors, devices,
config).
"""
