"""Starting ranks: the `loom` command line, local multi-process launch, Slurm submission."""
