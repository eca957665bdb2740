"""Offline data preparation: corpus, tokenizer, .bin/.idx building (no torch.distributed needed)."""
