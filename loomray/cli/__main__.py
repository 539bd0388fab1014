"""``python -m loomray.cli``: the ``loomray`` command without its console script."""

from loomray.cli.main import main

main()
