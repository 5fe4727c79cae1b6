"""Moved to :mod:`pointforge.implant.demo` (the demo runs the implant pipeline end to end); this path keeps working."""

from pointforge.implant.demo import DemoSettings, run_demo

__all__ = ["DemoSettings", "run_demo"]
