"""``python -m pointforge``: the ``pointforge`` program, run by this interpreter.

It is what torchrun starts on every rank (:mod:`pointforge.train.torchrun`
names the program, never a module of the command layer above it). It ends
the way a rank must end (:func:`pointforge.cli.entry.hard_exit`): with its
exit status, never hanging in the interpreter's teardown after a failed
collective.
"""

from pointforge.cli.entry import hard_exit, run
from pointforge.cli.main import app

if __name__ == "__main__":
    hard_exit(run(app))
