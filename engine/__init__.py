"""loom's training engine: everything that runs inside a training rank (never imports launch/ or tools/)."""
