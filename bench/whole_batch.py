"""What one process's random draws cost a data-parallel rank: a training step (forward and
backward) of one rank's rows of a small transformer with dropout (torch's
`nn.TransformerEncoderLayer`: dropout on the attention weights, inside
`F.multi_head_attention_forward`, and on the residual branches), three ways in one process:

- `per_rank`: the model as it is, each rank drawing its own masks (what
  `DistributedDataParallel` does: not one process's model);
- `row_draws`: inside `strategies.layers.whole_batch.RowDraws`, every draw over the batch's rows
made
  row by row from each global row's own generator (what `strategy=data` does: the same masks
  at every P), for the last rank of P;
- `no_dropout`: the same layers with dropout 0 (no draws at all), for scale.

    python bench/whole_batch.py [--rows 16] [--seq 32] [--width 64] [--ranks 2 8] [--repeats 30]

Medians of alternated repetitions, one torch thread. Prints JSON: seconds per step for each, and
each `row_draws` over `per_rank` (the price of masks that do not depend on P).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strategies.layers.whole_batch import RowDraws, forward_key
from strategies.probe import draw_plan


def model(width: int, dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=dropout,
                                                      batch_first=True) for _ in range(2)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="one rank's rows of the batch")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dropped, plain = model(args.width, 0.1), model(args.width, 0.0)
    x = torch.randn(args.rows, args.seq, args.width)
    plan = draw_plan(dropped, (args.seq, args.width))

    def step(net: nn.Module, ranks: int | None) -> float:
        began = time.perf_counter()
        if ranks is None:
            out = net(x)
        else:  # the last rank's rows
            with RowDraws(plan, forward_key(), (ranks - 1) * args.rows, args.rows):
                out = net(x)
        out.square().mean().backward()
        return time.perf_counter() - began

    ways = {"no_dropout": (plain, None), "per_rank": (dropped, None),
            **{f"row_draws_p{p}": (dropped, p) for p in args.ranks}}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for net, ranks in ways.values():  # warm-up (the dispatch mode's first use loads more)
        step(net, ranks)
    for _ in range(args.repeats):
        for name, (net, ranks) in ways.items():
            times[name].append(step(net, ranks))
    seconds = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({
        "rows_per_rank": args.rows, "seq": args.seq, "width": args.width,
        "draws_per_step": len(plan.cuts), "seconds_per_step": seconds,
        "row_draws_over_per_rank": {
            p: seconds[f"row_draws_p{p}"] / seconds["per_rank"] for p in args.ranks},
    }, indent=2))


if __name__ == "__main__":
    main()
