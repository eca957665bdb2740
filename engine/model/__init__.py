"""Decoder-only transformer built from tensor-parallel layers."""
