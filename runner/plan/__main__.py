"""`python -m runner.plan key=value ...`: the planner's command line (the only Hydra here).

Same config groups and overrides as training, plus `plan.*`; no MPI job is started (except by
`plan.calibrate=true`, which measures this machine's α and β).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from runner.console import make_console, print_error
from runner.core.registry import UnknownPluginError, accepted_options
from runner.plan.planner import Plan

EXIT_BAD_INPUT = 2


def main(argv: list[str]) -> int:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from runner.app import CONF_DIR, one_line

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=argv)
    except (HydraException, OmegaConfBaseException) as exc:
        print_error(one_line(exc))
        return EXIT_BAD_INPUT
    console = make_console()
    plan_cfg = cfg.plan
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
        plan = build_plan(cfg)
    except (ValueError, UnknownPluginError, TypeError) as exc:
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


def build_plan(cfg: DictConfig) -> Plan:
    """The plan for a composed config (no MPI: the model is built on the meta device)."""
    from runner.models import dataset_arguments
    from runner.plan.calibration import load_alpha_beta
    from runner.plan.planner import make_plan
    from runner.registry import DATASETS, MODELS, load_plugins
    from strategies import STRATEGIES
    from strategies.sparse_exchange import SPARSE_CHOICES, sparse_tables

    load_plugins()
    plan_cfg = cfg.plan
    world, batch = int(plan_cfg.world), int(cfg.trainer.batch_size)
    if world < 1 or batch < 1:
        raise ValueError(f"plan.world={world} and trainer.batch_size={batch} must be >= 1")
    model_options = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items()
                     if k != "name"}
    steps_per_epoch = None
    extra: dict = {}
    rows_touched = None
    if "sample_shape" in model_options:  # a model described by its own shapes (alexnet)
        sample_shape = tuple(int(d) for d in model_options["sample_shape"])
        classes = int(model_options["classes"])
    else:
        dataset_options = {k: v for k, v in
                           OmegaConf.to_container(cfg.dataset, resolve=True).items()
                           if k != "name"}
        dataset = DATASETS.get(cfg.dataset.name)(**dataset_options)
        spec = dataset.spec()
        sample_shape, classes = tuple(spec.input_shape), spec.num_classes
        steps_per_epoch = spec.train_size // batch
        extra = dataset_arguments(MODELS.get(cfg.model.name), spec)
        rows_touched = getattr(dataset, "expected_unique_tokens", None)
    with torch.device("meta"):
        model = MODELS.get(cfg.model.name)(sample_shape, classes, **extra, **model_options)
        model = model.to(getattr(torch, cfg.trainer.dtype))
    strategy_options = {k: v for k, v in OmegaConf.to_container(cfg.strategy).items()
                        if k != "name"}
    strategies = {}
    for name in plan_cfg.strategies:
        cls = STRATEGIES.get(name)
        options = strategy_options if name == cfg.strategy.name else {}
        accepted = accepted_options(cls)
        strategies[name] = cls(**{k: v for k, v in options.items() if k in accepted})
    if "data" in strategies and sparse_tables(model):
        # one row per sparse exchange mode: the comparison a user of embedding tables wants
        options = strategy_options if cfg.strategy.name == "data" else {}
        for mode in SPARSE_CHOICES:
            strategies[f"data sparse={mode}"] = STRATEGIES.get("data")(**{**options,
                                                                          "sparse": mode})
        del strategies["data"]
    ab = load_alpha_beta(plan_cfg.alpha, plan_cfg.beta)
    for strategy in strategies.values():
        strategy.alpha_beta, strategy.rows_touched = (ab.alpha, ab.beta), rows_touched
        strategy.local_costs = (ab.table_pass, ab.sparse_row)
    return make_plan(model, sample_shape, batch, world, strategies, ab.alpha, ab.beta,
                     ab.source, steps_per_epoch)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
