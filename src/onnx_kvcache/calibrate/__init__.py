"""Calibration: measuring a model's cache scales by running it (above ``runtime``, which runs it)."""
