"""`python -m loom ...` is the `loom` command (and `torchrun ... -m loom train ...` one rank of it)."""

if __name__ == "__main__":
    from loom.launch.cli import main

    raise SystemExit(main())
