"""pointforge: point-cloud networks from one CPU to many GPUs, and cranial implant design."""

__version__ = "0.1.0"
