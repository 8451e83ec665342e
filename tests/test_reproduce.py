"""`python -m runner.reproduce`: its pages from canned run directories (the numbers each page
derives, checked against values worked out by hand), the planner's section for real, and bad
options (one line, exit code 2). The full command trains for minutes; it is not run here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.report.data import load_run
from runner.reproduce import __main__ as reproduce
from runner.reproduce import grid, parallax, sc17

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def canned_run(path: Path, train: list[dict[str, Any]], val: list[dict[str, Any]],
               summary: dict[str, Any], config: dict[str, Any]) -> Path:
    """A run directory as gridrun leaves it: metrics.jsonl, summary.json, config.yaml."""
    path.mkdir(parents=True)
    lines = [json.dumps(r) for r in train] + [json.dumps({"split": "val", **r}) for r in val]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (path / "summary.json").write_text(json.dumps({"status": "completed", **summary}))
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def easgd_run(tmp_path: Path, name: str, step_s: float, comm_s: float,
              accuracies: list[float]) -> dict[str, Any]:
    """A method's canned run: 10 steps per evaluation, every step `step_s` long."""
    steps = 10 * len(accuracies)
    train = [{"step": s, "time_s": s * step_s, "loss": 1.0, "step_time_s": step_s,
              "comm_time_s": comm_s} for s in range(1, steps + 1)]
    val = [{"step": 10 * (i + 1), "time_s": 10 * (i + 1) * step_s, "accuracy": a, "loss": 0.5}
           for i, a in enumerate(accuracies)]
    run = canned_run(tmp_path / name, train, val,
                     {"val_accuracy": accuracies[-1], "median_step_time_s": step_s},
                     {"optimizer": {"name": name, "nesterov": False}})
    return sc17.summarize_run(name, load_run(run), target=0.9)


def test_sc17_page_from_canned_runs(tmp_path: Path) -> None:
    methods = [
        # reaches 0.9 at step 40 (not at its later 0.95): 40 x 50 ms = 2.0 s; comm 80%
        easgd_run(tmp_path, "easgd", 0.05, 0.04, [0.5, 0.7, 0.8, 0.91, 0.95]),
        easgd_run(tmp_path, "sync_easgd", 0.025, 0.005, [0.6, 0.92]),  # 0.5 s; comm 20%
        easgd_run(tmp_path, "async_easgd", 0.02, 0.01, [0.6, 0.8, 0.9]),  # 0.6 s
        easgd_run(tmp_path, "async_sgd", 0.03, 0.01, [0.6, 0.8, 0.9]),  # 0.9 s: slower
        easgd_run(tmp_path, "hogwild_easgd", 0.01, 0.001, [0.5, 0.6]),  # never reaches 0.9
        {"name": "async_msgd", "family": sc17.BASELINE, "status": "skipped",
         "note": "`optimizer=async_msgd` is not in this checkout yet"},
    ]
    assert methods[0]["steps_to_target"] == 40
    assert methods[0]["time_to_target_s"] == pytest.approx(2.0)
    assert methods[0]["comm_share"] == pytest.approx(0.8)
    results = {"steps": 50, "target": 0.9, "experiment": sc17.EXPERIMENT, "methods": methods}
    rows = {row[0]: row[1:] for row in sc17.comparisons(results)}
    speedup = rows["Sync EASGD's speedup over the original EASGD (time to target)"]
    assert speedup == ["5.3×", "4.00×", "yes"]
    assert rows["communication share: original EASGD → Sync EASGD"] == [
        "87% → 14%", "80% → 20%", "yes"]
    assert rows["`async_easgd` faster than `async_sgd`"][1:] == ["0.60 s vs 0.90 s", "yes"]
    assert "not compared" in rows["`async_measgd` faster than `async_msgd`"][1]
    assert rows["`hogwild_easgd` faster than `hogwild_sgd`"][1].startswith("not compared")
    assert rows["Sync EASGD ties for the best time (here: within 25% of the fastest)"][1:] == [
        "1 of 4 (0.50 s; fastest `sync_easgd` 0.50 s)", "yes"]

    page = sc17.render(results, tmp_path).read_text()
    assert "| `easgd` | original | ran | 40 | 2.00 | 50.0 | 80% |" in page
    assert "| `hogwild_easgd` | redesigned | ran | — | — |" in page
    assert "Skipped, not in this checkout yet: `async_msgd`" in page
    assert "optimizer.nesterov=false (its default)" in page
    for png in ("sc17_accuracy.png", "sc17_time_and_comm.png"):
        assert png in page and (tmp_path / png).read_bytes().startswith(PNG_MAGIC)


def test_sc17_skips_an_optimizer_that_is_not_registered(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    from runner.reproduce.runs import optimizer_missing

    assert optimizer_missing("sync_easgd") is None
    monkeypatch.setattr(sc17, "METHODS", {"no_such_optimizer": sc17.BASELINE})
    logged: list[str] = []
    results = sc17.collect(tmp_path, quick=True, log=logged.append)
    assert results["methods"] == [{
        "name": "no_such_optimizer", "family": sc17.BASELINE, "status": "skipped",
        "note": "`optimizer=no_such_optimizer` is not in this checkout yet "
                "(no conf/optimizer/no_such_optimizer.yaml)"}]
    assert logged and not (tmp_path / "no_such_optimizer").exists()  # nothing launched


def sparse_run(tmp_path: Path, mode: str, seq_len: int, density: float, step_s: float,
               held_bytes: int | None) -> dict[str, Any]:
    sparse = {} if mode == "dense" else {"sparse": {"0": {"mode": mode, "density": density}}}
    # the first steps (buffers being allocated) are slow and must not count
    train = [{"step": s, "step_time_s": 1.0 if s <= parallax.WARMUP_STEPS else step_s,
              **sparse} for s in range(1, 8)]
    exchange = ({"0": {"mode": mode, "held_bytes": held_bytes}}
                if mode != "dense" and held_bytes is not None else None)
    run = canned_run(tmp_path / f"{mode}_{seq_len}", train, [],
                     {"comm_bytes_per_step": 1e6 * density if mode != "dense" else 5.12e6,
                      "sparse_exchange": exchange},
                     {"dataset": {"vocab_size": 20000}, "model": {"embedding_dim": 64}})
    return {"seq_len": seq_len, "mode": mode, **parallax.measure(load_run(run))}


def parallax_points(tmp_path: Path, held: int | None) -> list[dict[str, Any]]:
    # dense / best sparse: 5 at 1%, 1.25 at 10%, 10/15 at 30% -> crossover between 10% and 30%
    timings = {8: (0.01, 0.010, 0.002, 0.003), 128: (0.10, 0.010, 0.009, 0.008),
               512: (0.30, 0.010, 0.020, 0.015)}
    points = []
    for seq_len, (density, dense, allgather, sharded) in timings.items():
        points.append(sparse_run(tmp_path, "dense", seq_len, density, dense, None))
        points.append(sparse_run(tmp_path, "allgather", seq_len, density, allgather, None))
        points.append(sparse_run(tmp_path, "sharded", seq_len, density, sharded, held))
    return points


def test_parallax_page_from_canned_runs(tmp_path: Path) -> None:
    data = parallax.summarize(parallax_points(tmp_path / "runs", held=1_280_000))
    dense_8 = next(p for p in data["points"] if p["mode"] == "dense" and p["seq_len"] == 8)
    assert dense_8["density"] == 0.01  # from the sparse runs of the same batches
    assert dense_8["median_step_s"] == 0.010  # the slow first steps left out
    # (1.25 - 1) / (1.25 - 2/3) of the way from 10% to 30%
    assert data["crossover"]["density"] == pytest.approx(0.1 + 0.2 * 0.25 / (1.25 - 2 / 3))
    assert data["crossover"]["measured"] == 0.30
    page = parallax.render(data, tmp_path).read_text()
    assert "about **18.6%** of the rows per rank" in page
    assert "| 8 | 1.00% | 5.12 MB, 10.0 ms | 0.01 MB, 2.0 ms | 0.01 MB, 3.0 ms |" in page
    assert "| dense (replicated on every rank) | 5.12 MB |" in page
    assert "1.28 MB (measured: `held_bytes`" in page
    assert (tmp_path / "parallax_exchange.png").read_bytes().startswith(PNG_MAGIC)
    assert parallax.headline(data)[0][3] == "18.6% of rows"

    unmeasured = parallax.summarize(parallax_points(tmp_path / "older", held=None))
    page = parallax.render(unmeasured, tmp_path).read_text()
    assert "so the measured figure was unavailable" in page
    assert parallax.headline(unmeasured)[1][3] == "5.12 MB → not measured"


def test_grid_section_plans_alexnet_for_real(tmp_path: Path) -> None:
    data = grid.collect(quick=True, log=lambda _: None)
    (row,) = data["rows"]
    assert (row["world"], row["batch"]) == (8, 256)
    # AlexNet's 58.6M fully-connected weights: splitting them beats pure batch parallelism
    assert row["best"]["strategy"] == "grid" and row["best"]["pr"] > 1
    assert row["pure_batch"]["comm_bytes"] > 4 * row["best"]["comm_bytes"]
    comm, step = grid.speedups(row)
    assert comm is not None and step is not None and comm > step > 1.0
    (out := tmp_path / "report").mkdir()
    (out / "grid.json").write_text(json.dumps({**data, "generated": "today"}))
    page = grid.render(data, out).read_text()
    best = row["best"]
    assert f"| 8 | 256 | grid {best['pr']} × {best['pc']} |" in page
    assert (out / "grid_speedup.png").read_bytes().startswith(PNG_MAGIC)
    index = reproduce.write_index(out).read_text()
    assert "[SPAA 2018" in index and f"{best['pr']} × {best['pc']}: {comm:.1f}×" in index
    assert "SC17" not in index.split("## Headline numbers")[1]  # not generated: not listed


@pytest.mark.parametrize(("argv", "message"), [
    (["--only", "nope"], "error: argument --only: invalid choice: 'nope'"),
    (["--bogus"], "error: unrecognized arguments: --bogus"),
    (["--out", "FILE"], "error: --out FILE: exists and is not a directory"),
])
def test_bad_options_are_one_line_and_exit_2(argv: list[str], message: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a == "FILE" else a for a in argv]
    with pytest.raises(SystemExit) as exited:
        reproduce.main(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith(message.replace("FILE", str(tmp_path / "FILE")))


@pytest.mark.parametrize("overrides", [
    ["experiment=sc17_table3", "optimizer=async_measgd"],
    ["experiment=parallax_tokens", "strategy.sparse=sharded"],
])
def test_the_experiments_compose_and_validate(overrides: list[str], tmp_path: Path) -> None:
    from runner.cli.app import precheck
    from runner.records.rundir import release_run_dirs

    run_dir = tmp_path / "run"
    try:
        assert precheck([*overrides, f"hydra.run.dir={run_dir}"]) is None
    finally:
        release_run_dirs()
    assert not run_dir.exists()
