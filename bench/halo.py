"""Halo exchange against the convolution it feeds, and overlapped against non-overlapped
height-split convolutions, in one MPI job per rank count.

    python bench/halo.py [--ranks 2 4] [--repeats 20]

A 3x3 convolution (64 -> 64 channels, padding 1) on a batch of 8 images of 128 x 128, one torch
thread per rank, its height split over the ranks:
- the halo exchange alone (start to finish) against the convolution of the rank's slab;
- forward + backward of the split layer with `overlap` on (interior rows computed while halos
  travel) and off (wait for the halos, then compute), alternating, medians.
Prints JSON with the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics

from timing import barrier_timed, run_worker

BATCH, CHANNELS, HEIGHT, WIDTH = 8, 64, 128, 128


def worker(repeats: int) -> None:
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch import nn

    from runner.core import ProcessGrid
    from runner.core.halo import halo_exchange_op
    from strategies.layers.spatial import SpatialWindowed

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(comm.Get_size(), 1, comm)
    torch.manual_seed(0)
    conv = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
    layers = {overlap: SpatialWindowed(conv, grid.model, HEIGHT, overlap)
              for overlap in (True, False)}
    plan = layers[True].plan
    slab = torch.randn(BATCH, CHANNELS, plan.own_rows[1] - plan.own_rows[0], WIDTH)

    halo = barrier_timed(comm, lambda: halo_exchange_op(slab, grid.model, 2, plan), repeats)
    local_conv = barrier_timed(comm, lambda: F.conv2d(slab, conv.weight, conv.bias, padding=1),
                               repeats)

    x = slab.clone().requires_grad_(True)
    probe = torch.randn_like(layers[True](x))

    def step(overlap: bool) -> None:
        conv.zero_grad()
        x.grad = None
        (layers[overlap](x) * probe).sum().backward()

    modes: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):  # alternate so drifts on a shared machine hit both alike
        for overlap in (True, False):
            modes[overlap] += barrier_timed(comm, lambda o=overlap: step(o), 1, warmup=0)
    medians = {k: statistics.median(v) for k, v in modes.items()}
    if comm.Get_rank() == 0:
        print(json.dumps({
            "ranks": comm.Get_size(), "halo_rows_sent_by_rank0": plan.send_rows,
            "halo_exchange_s": statistics.median(halo),
            "slab_conv_forward_s": statistics.median(local_conv),
            "halo_over_conv": statistics.median(halo) / statistics.median(local_conv),
            "fwd_bwd_overlapped_s": medians[True], "fwd_bwd_not_overlapped_s": medians[False],
            "overlapped_over_not": medians[True] / medians[False],
        }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.repeats)
        return
    runs = []
    for ranks in args.ranks:
        runs.append(run_worker(__file__, ranks, "--repeats", str(args.repeats)))
    print(json.dumps({"benchmark": "halo", "conv": f"3x3 {CHANNELS}->{CHANNELS}",
                      "input": [BATCH, CHANNELS, HEIGHT, WIDTH], "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
