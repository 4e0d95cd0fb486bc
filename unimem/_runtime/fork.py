"""The one ``os.fork()`` handler of the package.

Only the forking thread lives on in a child: a lock another thread held at the
fork would stay held for ever, and a GPU runtime's handles are dead. Each
layer knows what to reset; this module calls them, in an order that keeps the
layers one-way:

* before the fork: the core takes every allocator's lock (so the child gets
  allocators in a consistent state), first;
* after, in the parent: the core releases them;
* after, in the child: the core resets its allocators' locks first, then
  the runtime (the registries' creation locks, the device table's lock;
  allocators of devices that do not survive a fork refuse to work), then what upper layers registered with
  :func:`on_fork_in_child` at their import (the observability layer's history
  locks), then the backends whose modules are already imported (a fork never
  imports dpctl): a backend module with process-wide locks defines
  ``reset_after_fork_in_child()``.

``import unimem`` imports this module, so the handler is registered once for
every use of the package.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, List

from .. import _core
from . import devices, registry

BACKEND_PACKAGE = "unimem.backends."
BACKEND_RESET = "reset_after_fork_in_child"

_child_resets: List[Callable[[], None]] = []


def on_fork_in_child(reset: Callable[[], None]) -> None:
    """Call ``reset()`` in every forked child, after the core's and the
    runtime's resets (for layers above the runtime, which it does not import)."""
    _child_resets.append(reset)


def _before_fork() -> None:
    _core._before_fork()


def _after_fork_in_parent() -> None:
    _core._after_fork_in_parent()


def _after_fork_in_child() -> None:
    _core._after_fork_in_child()
    registry._after_fork_in_child()
    devices.reset_after_fork_in_child()
    for reset in list(_child_resets):
        reset()
    for name, module in list(sys.modules.items()):
        if name.startswith(BACKEND_PACKAGE) and module is not None:
            reset_backend = getattr(module, BACKEND_RESET, None)
            if reset_backend is not None:
                reset_backend()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
