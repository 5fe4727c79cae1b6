"""Samplers, one per module, each a network-free step on a shared base.

:mod:`.base` (the step contract and the re-spaced grids), :mod:`.ddpm`,
:mod:`.ddim`, :mod:`.dpmpp_2m` and :mod:`.registry` (a sampler by name).
A sampler turns the network's output into the next sample, as diffusers'
schedulers do; :func:`pointforge.nn.diffusion.pipeline.denoise` owns the loop.
"""
