"""The ``loomray`` command line: the console script is ``loomray.cli.main:main`` (see :mod:`loomray.cli.main`).

The package itself imports nothing, so that the session browser can reuse the
CLI's views (``loomray.cli.steering``, ``tree_view``, ...) without importing every
command, the ``ui`` command among them.
"""
