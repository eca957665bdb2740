"""Tensor, data and pipeline parallel building blocks: process groups, collectives, sharded layers."""
