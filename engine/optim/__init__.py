"""Gradient buffers and reduction, clipping, optimizers and learning-rate schedules."""
