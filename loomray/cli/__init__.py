"""The ``loomray`` command line (the console script is ``loomray.cli:main``); see :mod:`loomray.cli.main`."""

from loomray.cli.main import main

__all__ = ["main"]
