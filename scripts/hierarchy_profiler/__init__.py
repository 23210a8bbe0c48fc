"""Profile a compiled model by its call hierarchy (``node.meta["call_hierarchy"]``, RFC-0051).

Entry point: ``python -m scripts.profile_hierarchy`` (see :mod:`.cli`).
"""
