"""The implant product: a defective skull in; implant volume, mesh, proposals, uncertainty and report out.

``pipeline`` (the stages of one case), ``proposals``/``voxelize`` (the networks
at work), ``postprocess`` (vote, subtract, clean), ``writer`` and ``folder``
(one case's outputs, a whole dataset), ``metrics``, ``baseline`` and
``evaluate`` (scoring), ``view`` and ``export`` (3-D page, meshes, previews),
``demo`` (the whole system end to end). May import the upsampling product,
inference and every layer below.
"""
