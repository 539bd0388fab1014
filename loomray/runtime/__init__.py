"""Runtimes: where the loop runs and where its checkpoints and journal live.

``RayRuntime`` is imported lazily so that using the in-process runtimes (and
the loop itself) never imports Ray.
"""

from __future__ import annotations

from typing import Any

from loomray.runtime.base import Runtime
from loomray.runtime.inproc import InProcRuntime
from loomray.runtime.local import LocalRuntime

__all__ = ["Runtime", "InProcRuntime", "LocalRuntime", "RayRuntime"]  # noqa: F822 - RayRuntime is lazy (__getattr__)


def __getattr__(name: str) -> Any:
    if name == "RayRuntime":
        from loomray.runtime.ray_runtime import RayRuntime

        return RayRuntime
    raise AttributeError(f"module 'loomray.runtime' has no attribute {name!r}")
