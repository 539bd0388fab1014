"""Test helpers shipped with the library: polling with a deadline, and the processes a test started.

Importing this package does not import Ray (a test of a scripted model needs
none). The multi-node Ray cluster on one machine is
:func:`loomray.testing.cluster.local_cluster`; importing that module imports Ray.
"""

from loomray.testing.processes import Process, descendants, free_port, pid_alive, process_alive
from loomray.testing.waiting import wait_for

__all__ = ["Process", "descendants", "free_port", "pid_alive", "process_alive", "wait_for"]
