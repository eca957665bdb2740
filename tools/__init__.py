"""Operator tools: benchmarks and checks that run outside a training job."""
