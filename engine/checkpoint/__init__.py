"""Distributed, layout-independent checkpoints: save, load under any layout, the on-disk format."""
