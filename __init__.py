"""loom: a Megatron-style 3D-parallel LLM training engine.

The checkout's top-level folders are the subpackages: ``loom.engine`` (everything inside a
training rank), ``loom.data_tools`` (offline data preparation), ``loom.tools`` (checkpoint, Hugging
Face and benchmark tools) and ``loom.launch`` (the ``loom`` command, local and Slurm launch).
Presets ship as package data in ``loom/configs``. docs/architecture.md maps who may import whom.
"""

__version__ = "0.1.0"
