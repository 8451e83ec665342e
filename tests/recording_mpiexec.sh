#!/bin/sh
# A stand-in for a site launcher: records its arguments in the run directory (the last
# argument), then starts the job with the mpiexec beside the Python interpreter it was given.
python=""
for arg; do
  case "$arg" in */python*) [ -z "$python" ] && python="$arg" ;; esac
  last="$arg"
done
printf "%s " "$@" > "$last/launcher_args.txt"
exec "$(dirname "$python")/mpiexec" "$@"
