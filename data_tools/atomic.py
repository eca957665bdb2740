"""Atomic outputs for the data tools: the engine's helpers (one implementation for both)."""

from loom.engine.atomic import NAME_MAX, atomic_path, remove_stale_temporaries, staging_folder, temporary_sibling

__all__ = ["NAME_MAX", "atomic_path", "remove_stale_temporaries", "staging_folder", "temporary_sibling"]
