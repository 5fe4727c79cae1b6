"""The ``pointforge`` command: one module per command group, each a thin skin that parses, calls and prints.

Every command calls a function a user can import; nothing here computes what
the layers below do not. The top layer: it may import everything.
"""
