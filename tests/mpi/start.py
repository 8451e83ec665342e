"""`mpiexec -n N python tests/mpi/start.py SCRIPT ARGS`: the check script SCRIPT as
`python SCRIPT ARGS` runs it, its start-up without CPython's repeated full collections
(`runner.records.process`: a third of a second of each rank's imports on 2 cores), until
`harness.run_checks` begins."""

import runpy
import sys

from runner.records.process import defer_full_collections

defer_full_collections()
sys.argv.pop(0)
runpy.run_path(sys.argv[0], run_name="__main__")
