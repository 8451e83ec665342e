"""`python -m runner.plan key=value ...`: the planner's command line (the only Hydra here).

Same config groups and overrides as training, plus `plan.*`; no MPI job is started (except by
`plan.calibrate=true`, which measures this machine's α and β).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import DictConfig

from runner.config import PlanConfig, Plugin
from runner.console import make_console, print_error
from runner.core.registry import UnknownPluginError
from runner.plan.planner import Plan

EXIT_BAD_INPUT = 2


def main(argv: list[str]) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from runner.compose import compose, one_line
    from runner.config import ConfigError, parse_plan

    try:
        cfg = compose(argv)
        plan_cfg = parse_plan(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        print_error(one_line(exc))
        return EXIT_BAD_INPUT
    except ConfigError as exc:
        print_error(str(exc))
        return EXIT_BAD_INPUT
    console = make_console()
    if plan_cfg.calibrate:
        from runner.plan.calibration import calibration_path, measure

        console.print("measuring α and β (ping-pong on 2 ranks, all-reduce sweep on 4) ...")
        result = measure()
        for kind in ("point_to_point", "collective"):
            values = result[kind]
            console.print(f"{kind}: α = {values['alpha']:.3e} s, β = {values['beta']:.3e} s/B "
                          f"({1 / values['beta'] / 1e9:.2f} GB/s)")
        console.print(f"stored in {calibration_path()}: later plans and runs use it")
        return 0
    try:
        plan = build_plan(cfg, plan_cfg)
    except (ValueError, UnknownPluginError, TypeError, ConfigError) as exc:
        print_error(str(exc))
        return EXIT_BAD_INPUT
    from runner.plan.planner import layer_table, plan_json, plan_table

    console.print(plan_table(plan))
    refused: dict[str, list] = {}
    for row in plan.rows:
        if row.refused:
            refused.setdefault(row.strategy, []).append(row)
    # strategies refused at the same grids for the same reason (the sparse modes of `data`)
    # share one line
    lines: dict[tuple[str, str], list[str]] = {}
    for name, rows in refused.items():
        grids = ", ".join(f"{r.pr}x{r.pc}" for r in rows)
        lines.setdefault((grids, str(rows[0].refused)), []).append(name)
    for (grids, reason), names in lines.items():
        console.print(f"not possible: {', '.join(names)} at {grids}: {reason}")
    if plan_cfg.layers:
        for row in sorted(plan.feasible, key=lambda r: (r.comm_time, r.comm_bytes)):
            console.print(layer_table(plan, row))
    if plan_cfg.out:
        Path(plan_cfg.out).write_text(json.dumps(plan_json(plan), indent=2) + "\n")
        console.print(f"plan written to {plan_cfg.out}")
    return 0


def build_plan(cfg: DictConfig, plan_cfg: PlanConfig) -> Plan:
    """The plan for a composed config (no MPI: the model is built on the meta device)."""
    from runner import assembly
    from runner.config import parse
    from runner.machine import load_machine_costs
    from runner.plan.planner import make_plan
    from strategies.sparse_exchange import SPARSE_CHOICES, sparse_tables

    run = parse(cfg)
    world, batch = plan_cfg.world, run.trainer.batch_size
    if world < 1 or batch < 1:
        raise ValueError(f"plan.world={world} and trainer.batch_size={batch} must be >= 1")
    steps_per_epoch = rows_touched = None
    dtype = assembly.dtype_of(run)
    if "sample_shape" in run.model.options:  # a model described by its own shapes (alexnet)
        sample_shape = tuple(int(d) for d in run.model.options["sample_shape"])
        classes = int(run.model.options["classes"])
        model = assembly.build_model(run.model, sample_shape, classes, {}, dtype, "meta")
    else:
        dataset = assembly.build_dataset(run.dataset)
        spec = dataset.spec()
        sample_shape = tuple(spec.input_shape)
        steps_per_epoch = spec.train_size // batch
        rows_touched = assembly.rows_touched(dataset)
        model = assembly.model_for(run.model, spec, dtype, "meta")
    costs = load_machine_costs(plan_cfg.alpha, plan_cfg.beta)
    strategies = {}
    for name in plan_cfg.strategies:
        # the configured strategy with its options; the others with their defaults
        options = run.strategy.options if name == run.strategy.name else {}
        strategies[name] = assembly.build_strategy(Plugin(name, options), costs, rows_touched)
    if "data" in strategies and sparse_tables(model):
        # one row per sparse exchange mode: the comparison a user of embedding tables wants
        options = run.strategy.options if run.strategy.name == "data" else {}
        for mode in SPARSE_CHOICES:
            strategies[f"data sparse={mode}"] = assembly.build_strategy(
                Plugin("data", {**options, "sparse": mode}), costs, rows_touched)
        del strategies["data"]
    return make_plan(model, sample_shape, batch, world, strategies, costs, steps_per_epoch)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
