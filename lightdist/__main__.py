"""``python -m lightdist``: the ``lightdist`` command, run as the module ``lightdist.cli``.

Processes that multiprocessing starts with spawn (torch's checkpoint process per rank) import the main module of the
process that started them, but never a package's ``__main__``: run as ``lightdist.cli``, they import lightdist, and
with it the filters of ``lightdist/quiet.py``, as under the installed ``lightdist`` command.
"""

import runpy

runpy.run_module("lightdist.cli", run_name="__main__", alter_sys=True)
