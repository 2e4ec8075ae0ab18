"""Measuring and predicting speed: bench, calibrate, tune, projection, traces, the cost model and this machine."""
