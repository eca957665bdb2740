"""Run `loom train` from a tool, as a user would: the config as a TOML file, the CLI in a subprocess.

Tools sit below the launcher (launch/ imports tools/, never the reverse), so benchmarks and checks
that need a multi-rank run go through the command line rather than launch/'s Python API.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from loom.engine.config import LoomConfig
from loom.engine.config_io import config_to_toml
from loom.engine.run_dir import read_metrics


def train(config: LoomConfig, nproc: int) -> list[dict]:
    """Train `config` on `nproc` local ranks; returns the metrics rows. Raises with loom's message on failure."""
    run_dir = Path(config.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir.parent / f"{run_dir.name}.toml"
    config_file.write_text(config_to_toml(config))
    done = subprocess.run(
        [sys.executable, "-m", "loom.launch.cli", "train", "--config", str(config_file), "--nproc", str(nproc)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"loom train failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return read_metrics(run_dir)
