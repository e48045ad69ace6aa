"""Start-up measurement: building the engine's parts (startup.py), choosing kernel or XLA per
shape by timing (precision.py), bucket calibration, the measurement cache, and batch invariance
with its measured cost."""
