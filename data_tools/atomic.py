"""Atomic outputs for the data tools: the engine's helpers (one implementation for both)."""

from loom.engine.atomic import atomic_path, staging_folder, temporary_sibling

__all__ = ["atomic_path", "staging_folder", "temporary_sibling"]
