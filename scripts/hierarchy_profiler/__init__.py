"""Profile a compiled model by its call hierarchy (``node.meta["call_hierarchy"]``, RFC-0051).

Timing comes from ``torch.profiler``; attribution from Inductor's kernel provenance and the
nodes' call hierarchies.  API: :class:`CallHierarchyProfiler` (see :mod:`.api`); command
line: ``python -m scripts.profile_hierarchy`` (see :mod:`.cli`).
"""

from .api import CallHierarchyProfiler, ProfileError, ProfileResult

__all__ = ["CallHierarchyProfiler", "ProfileError", "ProfileResult"]
