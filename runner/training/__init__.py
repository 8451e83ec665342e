"""A rank: its process roles, the loop, start or resume, the step, sampling and evaluation, the
run's summary, stop signals, devices and precision, and the one assembly of dataset, model,
strategy and optimizer."""
