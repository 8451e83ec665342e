"""What a run leaves behind and shows: the run directory and its files read back within bounds, the
terminal, rank logs, TensorBoard, and the processes that hold a run directory."""
