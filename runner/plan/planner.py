"""Which grid to use: every factorisation `Pr × Pc` of a world size, for every strategy that can
run it, with the bytes and α–β time each step would communicate. No Hydra, no MPI."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table
from torch import nn

from runner.core import GridShape
from runner.cost.collectives import CommOp, MachineCosts, comm_seconds, loss_op, step_bytes
from strategies.base import Strategy, predict_rank_bytes, predict_step


@dataclass
class PlanRow:
    strategy: str
    pr: int
    pc: int
    ops: list[CommOp] = field(default_factory=list)
    comm_bytes: int = 0
    comm_time: float = 0.0
    param_bytes: int = 0
    activation_bytes: int = 0
    refused: str | None = None
    compute_time: float = 0.0  # forward, backward and update at this machine's rates
    step_time: float = 0.0  # compute + communication
    layouts: dict[str, str] | None = None  # strategy=auto: each layer's chosen layout
    # a model split by a plan by module name: where the plan came from, and each of its
    # modules as (path, style, predicted bytes per step)
    plan_source: str | None = None
    plan_modules: list[tuple[str, str, int]] | None = None
    # rank 0's bytes for the model in a step (`predict_rank_bytes`)
    memory_bytes: int = 0


@dataclass
class Plan:
    world: int
    batch: int
    alpha: float
    beta: float
    alpha_beta_source: str
    rows: list[PlanRow]
    costs: MachineCosts
    rates_source: str = "default"
    steps_per_epoch: int | None = None

    @property
    def feasible(self) -> list[PlanRow]:
        return [row for row in self.rows if row.refused is None]

    @property
    def best(self) -> PlanRow | None:
        rows = self.feasible
        return min(rows, key=order) if rows else None


def order(row: PlanRow) -> tuple[float, float, int]:
    """Fastest predicted step first; equal steps by less communication."""
    return (row.step_time, row.comm_time, row.comm_bytes)


def factorisations(world: int) -> list[tuple[int, int]]:
    return [(pr, world // pr) for pr in range(1, world + 1) if world % pr == 0]


def make_plan(model: nn.Module, sample_shape: tuple[int, ...], batch: int, world: int,
              strategies: dict[str, Strategy], costs: MachineCosts, *,
              steps_per_epoch: int | None = None, state_copies: int = 0) -> Plan:
    """Every strategy at every factorisation of `world`, predicted; `state_copies`: the
    optimizer's parameter-shaped tensors of state per parameter (for the memory per rank)."""
    itemsize = next(model.parameters()).element_size()
    rows = []
    for name, strategy in strategies.items():
        for pr, pc in factorisations(world):
            grid = GridShape(pr, pc)
            problems = (strategy.check(grid, batch)
                        or strategy.check_model(model, sample_shape, grid))
            if problems:
                rows.append(PlanRow(name, pr, pc, refused=problems[0]))
                continue
            ops = (strategy.predict_ops(model, sample_shape, grid, batch)
                   + loss_op(grid.size, itemsize))
            step = predict_step(strategy, model, sample_shape, grid, batch)
            describe = getattr(strategy, "describe_plan", None)
            planned = getattr(strategy, "plan_modules", None)
            by_plan = planned(model, sample_shape, grid, batch) if planned else None
            rows.append(PlanRow(
                name, pr, pc, ops, step_bytes(ops), comm_seconds(ops, costs),
                strategy.predict_param_bytes(model, sample_shape, grid),
                strategy.predict_activation_bytes(model, sample_shape, grid, batch),
                compute_time=step.compute_s, step_time=step.total_s,
                layouts=describe(model, sample_shape, grid, batch) if describe else None,
                plan_source=by_plan[0] if by_plan else None,
                plan_modules=([(m.path, m.style, m.comm_bytes) for m in by_plan[1]]
                              if by_plan else None),
                memory_bytes=predict_rank_bytes(strategy, model, sample_shape, grid, batch,
                                                state_copies)))
    rates = next(iter(strategies.values())).pricing.rates.source if strategies else "default"
    return Plan(world, batch, costs.alpha, costs.beta, costs.source, rows, costs, rates,
                steps_per_epoch)


def by_layer(row: PlanRow, costs: MachineCosts) -> list[dict[str, Any]]:
    """Bytes and time per layer (or per gradient bucket, boundary, loss)."""
    groups: dict[str, list[CommOp]] = defaultdict(list)
    for op in row.ops:
        groups[op.layer].append(op)
    return [{"layer": layer, "ops": [o.op for o in ops], "comm_bytes": step_bytes(ops),
             "comm_time_s": comm_seconds(ops, costs)}
            for layer, ops in groups.items()]


def plan_json(plan: Plan) -> dict[str, Any]:
    best = plan.best
    return {
        "world": plan.world, "batch": plan.batch, "alpha": plan.alpha, "beta": plan.beta,
        "compute_rates_source": plan.rates_source,
        "alpha_beta_source": plan.alpha_beta_source, "steps_per_epoch": plan.steps_per_epoch,
        "rows": [{"strategy": r.strategy, "pr": r.pr, "pc": r.pc,
                  "comm_bytes_per_step": r.comm_bytes, "comm_time_s_per_step": r.comm_time,
                  "compute_time_s_per_step": r.compute_time,
                  "step_time_s": r.step_time, "layouts": r.layouts,
                  "plan_source": r.plan_source,
                  "plan_modules": (None if r.plan_modules is None else
                                   [{"module": path, "style": style, "comm_bytes": n}
                                    for path, style, n in r.plan_modules]),
                  "layers": by_layer(r, plan.costs),
                  "param_bytes_per_rank": r.param_bytes,
                  "memory_bytes_per_rank": r.memory_bytes,
                  "activation_bytes_per_rank": r.activation_bytes}
                 for r in plan.feasible],
        "refused": [{"strategy": r.strategy, "pr": r.pr, "pc": r.pc, "reason": r.refused}
                    for r in plan.rows if r.refused],
        "best": None if best is None else {"strategy": best.strategy, "pr": best.pr,
                                           "pc": best.pc},
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f}"


def plan_table(plan: Plan) -> Table:
    best = plan.best
    title = (f"plan: {plan.world} ranks, global batch {plan.batch}, α={plan.alpha:.2e} s, "
             f"β={plan.beta:.2e} s/B ({plan.alpha_beta_source}), compute rates "
             f"({plan.rates_source}); predicted step = compute + communication")
    table = Table(title=title, title_justify="left")
    headers = ["strategy", "pr x pc", "step ms", "compute ms", "comm ms", "MB / step",
               "params MB / rank", "activations MB / rank", "memory MB / rank"]
    if plan.steps_per_epoch:
        headers += ["MB / epoch", "comm s / epoch"]
    for header in headers:
        table.add_column(header, justify="left" if header == "strategy" else "right")
    for row in sorted(plan.feasible, key=order):
        mark = " ← best" if row is best else ""
        cells = [row.strategy + mark, f"{row.pr} x {row.pc}", f"{row.step_time * 1e3:,.3f}",
                 f"{row.compute_time * 1e3:,.3f}", f"{row.comm_time * 1e3:,.3f}",
                 _mb(row.comm_bytes), _mb(row.param_bytes), _mb(row.activation_bytes),
                 _mb(row.memory_bytes)]
        if plan.steps_per_epoch:
            cells += [_mb(row.comm_bytes * plan.steps_per_epoch),
                      f"{row.comm_time * plan.steps_per_epoch:,.2f}"]
        table.add_row(*cells, style="bold green" if row is best else None)
    return table


def layer_table(plan: Plan, row: PlanRow) -> Table:
    table = Table(title=f"{row.strategy} {row.pr} x {row.pc}: per layer", title_justify="left")
    for header in ("layer", "operations", "MB / step", "comm ms / step"):
        table.add_column(header, justify="left" if header in ("layer", "operations") else "right")
    for item in by_layer(row, plan.costs):
        table.add_row(item["layer"], ", ".join(item["ops"]), _mb(item["comm_bytes"]),
                      f"{item['comm_time_s'] * 1e3:,.3f}")
    return table


def layouts_table(row: PlanRow) -> Table:
    """strategy=auto's layout for each layer (by its name in the model: what
    `strategy.layouts` pins)."""
    table = Table()
    table.add_column("layer", justify="left")
    table.add_column("layout", justify="left")
    for layer, layout in (row.layouts or {}).items():
        table.add_row(layer, layout)
    return table


def plan_modules_table(row: PlanRow) -> Table:
    """A plan by module name: each module's style and predicted bytes per step."""
    table = Table(title=f"{row.strategy} {row.pr} x {row.pc}: the plan {row.plan_source}",
                  title_justify="left")
    for header in ("module", "style", "MB / step"):
        table.add_column(header, justify="right" if header == "MB / step" else "left")
    for path, style, nbytes in row.plan_modules or []:
        table.add_row(path, style, _mb(nbytes))
    return table


@dataclass(frozen=True)
class Fit:
    """Where a strategy first fits a memory budget: the smallest world, its fastest grid."""

    strategy: str
    row: PlanRow | None  # None: at no world planned
    world: int | None


def smallest_fits(plans: list[Plan], budget: float) -> list[Fit]:
    """For each strategy of `plans` (one plan per world, ascending), the smallest world at
    which a grid of it needs at most `budget` bytes per rank, and the fastest such grid."""
    names = list(dict.fromkeys(row.strategy for plan in plans for row in plan.rows))
    found = []
    for name in names:
        fit = Fit(name, None, None)
        for plan in plans:
            rows = [r for r in plan.feasible if r.strategy == name and r.memory_bytes <= budget]
            if rows:
                fit = Fit(name, min(rows, key=lambda r: r.step_time), plan.world)
                break
        found.append(fit)
    return found


def fits_table(fits: list[Fit], budget: float, largest: int) -> Table:
    table = Table(title=f"the smallest world at which each strategy fits in {_mb(budget)} MB "
                        f"per rank (of 1 to {largest} ranks)", title_justify="left")
    for header in ("strategy", "ranks", "pr x pc", "memory MB / rank", "step ms"):
        table.add_column(header, justify="left" if header == "strategy" else "right")
    for fit in sorted(fits, key=lambda f: (f.world is None, f.world or 0,
                                           f.row.step_time if f.row else 0.0)):
        if fit.row is None:
            table.add_row(fit.strategy, "does not fit", "", "", "")
        else:
            table.add_row(fit.strategy, str(fit.world), f"{fit.row.pr} x {fit.row.pc}",
                          _mb(fit.row.memory_bytes), f"{fit.row.step_time * 1e3:,.3f}")
    return table
