"""Runtime data: the .bin/.idx format, GPT samples, blending and the per-rank batch iterator."""
