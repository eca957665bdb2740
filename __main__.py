"""`python -m loom ...` is the `loom` command (and `torchrun ... -m loom train ...` one rank of it)."""

from loom.launch.cli import main

raise SystemExit(main())
