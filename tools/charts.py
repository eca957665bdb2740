"""Charts loom draws (`loom plan --plot`, `loom schedule --output`): marked in their metadata with the command
that drew them, saved whole, and never drawn over a file that command did not draw unless told to (--overwrite).
No torch here: `loom plan` does not import it."""

from __future__ import annotations

import os
from pathlib import Path

from loom.engine.atomic import cannot_create
from loom.engine.config import ConfigError

CHART_MARK = "drawn by loom"
"""Written into every chart's metadata with the command that drew it, so that a rerun of that command may redraw
its own chart and nothing else."""


CHART_SIGNATURES = (b"\x89PNG", b"%PDF", b"<?xml", b"<svg")
"""How the files matplotlib writes as PNG, PDF and SVG begin."""


def _chart_metadata(command: str) -> str:
    return f"loom {command} ({CHART_MARK})"


def _drawn_by(path: Path, command: str) -> bool:
    """A chart file (by its first bytes) whose metadata says `loom {command}` drew it."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    mark = _chart_metadata(command)
    pdf_mark = mark.replace("(", "\\(").replace(")", "\\)")  # a PDF string escapes its parentheses
    return data.startswith(CHART_SIGNATURES) and (mark.encode() in data or pdf_mark.encode() in data)


def claim_chart_file(output: Path, flag: str, overwrite: bool, command: str) -> None:
    """A chart for `loom {command}` to draw: a new file, or one that command drew before (a rerun redraws it);
    anything else, another command's chart included, only with --overwrite. Checked, with whether the file can be
    written at all, before the command's work. A symbolic link is written through, as any other program writes to
    it."""
    output = Path(os.path.realpath(output))
    if output.exists() and not overwrite:
        if not _drawn_by(output, command):
            raise ConfigError(
                f"{flag} {output} exists and is not a chart `loom {command}` drew; give another file, or pass "
                "--overwrite to replace it"
            )
    if not output.exists() and (why := cannot_create(output)):
        raise ConfigError(f"{flag} {output}: cannot write there ({why})")


def save_chart(figure, output: Path, command: str) -> None:
    """Save a matplotlib figure as `output` (its suffix picks the format), marked as loom's, all at once."""
    output = Path(os.path.realpath(output))
    key = "Software" if output.suffix.lower() == ".png" else "Creator"
    partial = output.with_name(f".{output.name}.partial{output.suffix}")
    try:
        figure.savefig(partial, dpi=120, metadata={key: _chart_metadata(command)})
    except OSError as error:  # matplotlib writes through a file object: its error names no file
        partial.unlink(missing_ok=True)
        raise OSError(error.errno, error.strerror or str(error), str(output)) from None
    partial.replace(output)
