"""Runs the model: loading weights, the per-step forward batch, the model runner."""
