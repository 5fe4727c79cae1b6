"""Gaussian diffusion for point-cloud completion (PCDiff), with no knowledge of the network.

Import from the modules, not from here:

* :mod:`.schedule` — the discrete noise schedule and its tables;
* :mod:`.loss` — the training loss and its targets (ε, x0 or v);
* :mod:`.conditioning` — how a conditioned cloud ``[condition | generated]``
  meets the network, and the condition mark;
* :mod:`.samplers` — one sampler per module, each turning a network output
  into the next sample without ever calling the network;
* :mod:`.pipeline` — the one denoising loop, which calls the network and
  hands its output to a sampler.

The package imports only torch, numpy and :mod:`pointforge.errors`.
"""
