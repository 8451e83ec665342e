"""`python -m runner ARGS` for the tests, without an interpreter start and torch's import per run.

Every command-line run of the suite starts a head that imports torch, Hydra and the plugins
(1.5-2 s of CPU on 2 cores, before it validates and starts any rank): over the suite's ~100
heads, minutes. Here a head is forked from a server that imported those modules once
(multiprocessing's forkserver, which forks a fresh child per run from a process that has never
run anything), and then runs `python -m runner`'s own code as that command would: `runner`'s
`__main__` with the arguments in `sys.argv`, from the given directory, with the given
environment, its standard output and error in files, its exit code the process's. mpiexec starts
its ranks as it would, with the suite's warm interpreter as the head's `sys.executable`
(`tests.warm_ranks`).

A fork must not copy a thread pool: torch's import starts OpenMP's, so the server imports with
OMP_NUM_THREADS=1 and a head sets torch's threads to what a fresh process has (`FRESH_THREADS`,
read when the suite is collected, before any test could change this process's).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from tests import warm_ranks

# What a head imports before it validates a run (what every head would import again).
PRELOAD = ["torch", "hydra", "runner.cli.app", "runner.cli.launch", "runner.cli.validation",
           "runner.cli.preflight", "runner.training.assembly", "runner.training.loop",
           "runner.training.rank", "strategies",
           # the transformers library and the models the suite's heads build (~3.5 s of
           # imports a head each; a module that is not installed is skipped)
           "transformers", "transformers.conversion_mapping",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.vit.modeling_vit", "transformers.models.bert.modeling_bert"]

# GRIDRUN_TEST_SUBPROCESS_HEADS=1: every head a fresh interpreter, as a user's shell starts it.
SUBPROCESS_HEADS = os.environ.get("GRIDRUN_TEST_SUBPROCESS_HEADS") == "1"
# Read in the suite's own process (the forked heads import this module under the server's
# OMP_NUM_THREADS=1, and are given it).
FRESH_THREADS = torch.get_num_threads()
_context: ForkServerContext | None = None


def _server() -> ForkServerContext:
    """The forkserver, started on first use with the modules above imported."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # no thread pool in the process that forks
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _context = context
    return _context


def _head(module: str, args: list[str], cwd: str, env: dict[str, str], out: str, err: str,
          threads: int, python: str) -> None:
    """In the forked child: `python -m MODULE ARGS` from `cwd` with `env`, to its exit code
    (what the interpreter would print for an uncaught exception or a `sys.exit` message, too).
    `python`: the interpreter the head starts its ranks with (`tests.warm_ranks`)."""
    from runner.records.process import exit_code

    sys.executable = python
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for path, fd in ((out, 1), (err, 2)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    torch.set_num_threads(threads)
    sys.path.insert(0, cwd)  # as `python -m` puts it first
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def _started(module: str, jobs: list[list[str]], cwd: Path, env: dict[str, str] | None
             ) -> Iterator[list[tuple[BaseProcess, Path, Path]]]:
    """A forked head per job, each with its output files; any still running at the end is
    stopped (SIGTERM: the head forwards it to its ranks)."""
    context = _server()
    python = warm_ranks.python()
    environment = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="gridrun-head-") as folder:
        started = []
        try:
            for index, args in enumerate(jobs):
                out, err = Path(folder) / f"{index}.out", Path(folder) / f"{index}.err"
                process = context.Process(target=_head, args=(
                    module, args, str(cwd), environment, str(out), str(err), FRESH_THREADS,
                    python))
                process.start()
                started.append((process, out, err))
            yield started
        finally:
            for process, _, _ in started:
                if process.is_alive():
                    process.terminate()
                    process.join()


def _read(path: Path) -> str:
    """What a head wrote to `path` (nothing, where it ended before it began)."""
    return path.read_text(errors="replace") if path.exists() else ""


def _result(module: str, args: list[str], process: BaseProcess, out: Path, err: Path
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess([sys.executable, "-m", module, *args],
                                       process.exitcode if process.exitcode is not None else -1,
                                       _read(out), _read(err))


def _fresh_heads(module: str, jobs: list[list[str]], cwd: Path, timeout: float,
                 env: dict[str, str] | None) -> list[subprocess.CompletedProcess[str]]:
    """`run_heads` with a fresh interpreter for every head."""
    processes = [subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd,
                                  env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for args in jobs]
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(process.args, process.returncode,
                                                       stdout, stderr))
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()  # the head forwards it to its ranks
                process.communicate()
    return results


def run_heads(module: str, jobs: list[list[str]], cwd: Path, timeout: float,
              env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess[str]]:
    """`python -m MODULE ARGS` for every job at once, forked heads (fresh interpreters under
    `SUBPROCESS_HEADS`); `subprocess.TimeoutExpired` where one is still running after `timeout`
    seconds (all are stopped then)."""
    if SUBPROCESS_HEADS:
        return _fresh_heads(module, jobs, cwd, timeout, env)
    with _started(module, jobs, cwd, env) as started:
        results = []
        for (process, out, err), args in zip(started, jobs, strict=True):
            process.join(timeout)
            if process.is_alive():
                process.terminate()
                process.join()
                raise subprocess.TimeoutExpired([sys.executable, "-m", module, *args], timeout,
                                                _read(out), _read(err))
            results.append(_result(module, args, process, out, err))
        return results
