"""The head: the process the user started. The entry point, --help, Hydra's composition, the checks
before a run, the launch of the MPI job and the watch over it, multirun sweeps, and the worker
entry that each rank of the job starts."""
