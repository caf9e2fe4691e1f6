"""The parts of bench/gpu_smoke.py: the model and batch, memory readings, and one module per section."""
