"""Offline data preparation: corpus, JSONL I/O, tokenizer training and .bin/.idx building (no torch here)."""
