"""Checkpoints that prove themselves, in one process (no MPI): real checkpoints written by
`save_checkpoint` on a 1 x 1 grid, then damaged the ways a disk, a copy or a hostile tester
damages them. Every damage is one line naming the checkpoint, the file and the reason;
`resume=auto` falls back past it (and refuses when every checkpoint is damaged); a named damaged
checkpoint is refused."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from runner.checkpoint.layout import CheckpointError, DamagedCheckpoint
from runner.checkpoint.read import Checkpoint
from runner.checkpoint.resume import (
    find_resume_checkpoint,
    hydra_quoted,
    parameter_shapes,
    resume_command,
    verify_resume,
)
from runner.checkpoint.write import TrainingProgress, save_checkpoint
from runner.cli.compose import compose
from runner.cli.validation import validate
from runner.config.schema import RunConfig
from runner.core import ProcessGrid
from runner.core.placement import place_whole
from runner.optim.sync import SynchronousSGD
from runner.records.rundir import RunDir
from runner.training import assembly
from runner.training.resume import start_or_resume
from runner.training.sampling import EpochSampler
from runner.training.step import StepFailure

SHARD = "rank-00000.pt"
OVERRIDES = ["grid.pr=1", "grid.pc=1", "strategy=data", "optimizer.momentum=0.9",
             "model.hidden=[32,16]"]


def run_config(*overrides: str) -> RunConfig:
    return validate(compose([*OVERRIDES, *overrides]), world_size=1)


def parallel_model(run: RunConfig) -> Any:
    """The data-parallel model of `run` on a 1 x 1 grid, as `build_training` makes it."""
    parts = assembly.assemble(run)
    place_whole(parts.model)
    return parts.strategy.parallelize(parts.model, parts.spec.input_shape, ProcessGrid(1, 1))


def meta_model(*overrides: str) -> torch.nn.Module:
    """The sequential model on the meta device, as the head builds it before any rank."""
    run = run_config(*overrides)
    spec = assembly.build_dataset(run.dataset).spec()
    return assembly.model_for(run.model, spec, assembly.dtype_of(run), device="meta")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with two good checkpoints, at steps 20 and 40 (momentum included)."""
    run_dir = tmp_path_factory.mktemp("pristine")
    run = run_config()
    torch.manual_seed(0)
    grid = ProcessGrid(1, 1)
    model = parallel_model(run)
    optimizer = SynchronousSGD(model, grid=grid, total_steps=100, momentum=0.9)
    sampler = EpochSampler(64, 8, seed=0)
    for step in (20, 40):
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        optimizer.step(step)
        sampler.next_batch()
        save_checkpoint(run_dir / "checkpoints", TrainingProgress(step, step / 10, sampler.state()),
                        model, optimizer, grid, {"config": {}})
    return run_dir


@pytest.fixture()
def run_dir(pristine: Path, tmp_path: Path) -> Path:
    """A copy of the pristine run directory for one test to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "run"))


def step(run_dir: Path, number: int) -> Path:
    return run_dir / "checkpoints" / f"step-{number:08d}"


def refusal(call: Any, *args: Any) -> str:
    """The one-line CheckpointError that `call(*args)` raises."""
    with pytest.raises(CheckpointError) as caught:
        call(*args)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def verify(path: Path | str, model: torch.nn.Module | None = None) -> tuple[Path | None, list]:
    checkpoints = Path(path) / "checkpoints"
    return verify_resume(str(path), checkpoints, model or meta_model())


def rewrite_manifest(checkpoint: Path, change: Any) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    change(manifest)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def rehash(checkpoint: Path, name: str = SHARD) -> None:
    """What a hostile writer does after replacing a shard: make the manifest agree with it."""
    data = (checkpoint / name).read_bytes()
    rewrite_manifest(checkpoint, lambda m: m["shards"].__setitem__(
        name, {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


def test_each_shard_is_hashed_as_written_and_a_good_checkpoint_verifies(run_dir: Path) -> None:
    checkpoint = step(run_dir, 40)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / SHARD).read_bytes()
    assert manifest["format"] == 2
    assert manifest["shards"] == {SHARD: {"bytes": len(data),
                                          "sha256": hashlib.sha256(data).hexdigest()}}
    assert verify(checkpoint) == (checkpoint, [])
    assert verify(run_dir) == (checkpoint, [])  # a run directory: its newest
    assert verify_resume("auto", run_dir / "checkpoints", meta_model()) == (checkpoint, [])
    assert verify_resume(None, run_dir / "checkpoints", meta_model()) == (None, [])


def test_a_flipped_bit_in_tensor_data_is_a_sha256_mismatch(run_dir: Path) -> None:
    checkpoint = step(run_dir, 40)
    weight = torch.load(checkpoint / SHARD, weights_only=True)["model/-/1.weight/0:32"]
    data = bytearray((checkpoint / SHARD).read_bytes())
    at = data.find(weight.numpy().tobytes()) + weight.numel() * weight.element_size() // 2
    data[at] ^= 0x04
    (checkpoint / SHARD).write_bytes(data)
    damaged = torch.load(checkpoint / SHARD, weights_only=True)["model/-/1.weight/0:32"]
    assert not torch.equal(damaged, weight)  # unpickling alone would have trained on it
    expected = f"checkpoint {checkpoint}: {SHARD}: sha256 mismatch"
    assert refusal(verify, checkpoint).startswith(expected)
    assert refusal(Checkpoint(checkpoint).rank_state, 0).startswith(expected)  # on a rank


def test_a_truncated_shard_is_named_with_its_size(run_dir: Path) -> None:
    checkpoint = step(run_dir, 40)
    size = (checkpoint / SHARD).stat().st_size
    os.truncate(checkpoint / SHARD, size // 2)
    expected = f"checkpoint {checkpoint}: {SHARD}: truncated: {size // 2} of {size} bytes"
    assert refusal(verify, checkpoint) == expected
    assert refusal(Checkpoint(checkpoint).rank_state, 0) == expected
    assert refusal(find_resume_checkpoint, str(checkpoint), None, False) == expected


def test_a_manifest_that_is_not_json_is_named(run_dir: Path) -> None:
    checkpoint = step(run_dir, 40)
    (checkpoint / "manifest.json").write_text("{not json")
    message = refusal(verify, checkpoint)
    assert message.startswith(f"checkpoint {checkpoint}: manifest.json: not JSON (Expecting")


def test_a_missing_shard_is_named(run_dir: Path) -> None:
    checkpoint = step(run_dir, 40)
    (checkpoint / SHARD).unlink()
    assert refusal(verify, checkpoint) == f"checkpoint {checkpoint}: {SHARD}: missing"
    with pytest.raises(DamagedCheckpoint) as caught:
        Checkpoint(checkpoint).verify()
    assert (caught.value.path, caught.value.file, caught.value.reason) == (checkpoint, SHARD,
                                                                           "missing")
    assert refusal(find_resume_checkpoint, str(checkpoint), None, False).endswith("missing")


class _Smuggled:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def test_a_pickled_object_is_refused_in_one_line_and_never_runs(run_dir: Path,
                                                                tmp_path: Path) -> None:
    """The manifest is made to agree with the forged shard: the hash passes, the unpickler
    refuses."""
    checkpoint, marker = step(run_dir, 40), tmp_path / "code_ran"
    payload = torch.load(checkpoint / SHARD, weights_only=True)
    payload["rng"] = _Smuggled(str(marker))
    torch.save(payload, checkpoint / SHARD)
    rehash(checkpoint)
    expected = (f"checkpoint {checkpoint}: {SHARD}: refused by weights_only loading: "
                f"Trying to load unsupported GLOBAL posix.system")
    assert refusal(verify, checkpoint).startswith(expected)
    assert refusal(Checkpoint(checkpoint).rank_state, 0).startswith(expected)
    assert not marker.exists()


def test_a_checkpoint_of_another_model_is_refused_by_the_head(run_dir: Path) -> None:
    checkpoint = step(run_dir, 40)
    assert refusal(verify, checkpoint, meta_model("model.hidden=[48,16]")) == (
        f"checkpoint {checkpoint}: manifest.json: not a checkpoint of this model: 1.weight has "
        f"shape [32, 64] in the checkpoint and [48, 64] in this model (another model or "
        f"dataset?)")
    deeper = meta_model("model.hidden=[32,16,10]")  # the same layers and one more
    assert refusal(verify, checkpoint, deeper).endswith(
        "not a checkpoint of this model: it has no model tensor for 7.weight (another model or "
        "dataset?)")
    fewer = {k: v for k, v in parameter_shapes(meta_model()).items() if k != "5.bias"}
    assert Checkpoint(checkpoint).model_problem(fewer) == (
        "its model tensor '5.bias' is not a parameter of this model")
    # also under auto: another model's checkpoint is a mistake, not damage to skip
    assert "not a checkpoint of this model" in refusal(
        verify_resume, "auto", run_dir / "checkpoints", deeper)


def test_entries_beyond_their_tensor_or_unlike_their_shard_are_refused(run_dir: Path) -> None:
    checkpoint = step(run_dir, 40)
    rewrite_manifest(checkpoint, lambda m: m["files"][SHARD][0].__setitem__(5, 999))
    assert refusal(verify, checkpoint) == (f"checkpoint {checkpoint}: manifest.json: {SHARD}: "
                                           f"entry 1.weight: rows 0:999 outside its 32 rows")
    checkpoint = step(run_dir, 20)
    payload = torch.load(checkpoint / SHARD, weights_only=True)
    payload["model/-/1.weight/0:32"] = torch.zeros(3, 3)
    torch.save(payload, checkpoint / SHARD)
    rehash(checkpoint)
    assert refusal(verify, checkpoint).endswith(
        "tensor model/-/1.weight/0:32 has shape [3, 3], the manifest says [32, 64]")


@pytest.mark.parametrize("name", ["../outside/x.pt", "../../../../etc/passwd", "/etc/passwd",
                                  "sub/rank-00000.pt", "rank-0.pt", "rank-000000.pt",
                                  "rank-00000.pt/.", "..", "rank-00000.pt\x00x", "rank-٠٠٠٠٠.pt"])
def test_shard_names_are_confined_to_the_checkpoint_directory(run_dir: Path, tmp_path: Path,
                                                              name: str) -> None:
    """A name outside `rank-NNNNN.pt` is refused before any file is opened, even when what it
    names is a perfectly good shard."""
    checkpoint = step(run_dir, 40)
    outside = checkpoint.parent / "outside"
    outside.mkdir()
    shutil.copy(checkpoint / SHARD, outside / "x.pt")

    def rename(manifest: dict) -> None:
        for key in ("files", "shards"):
            manifest[key] = {name: manifest[key][SHARD]}

    rewrite_manifest(checkpoint, rename)
    message = refusal(verify, checkpoint)
    assert message == (f"checkpoint {checkpoint}: manifest.json: shard name {name!r} refused: "
                       f"a shard is rank-NNNNN.pt inside the checkpoint directory")
    assert refusal(Checkpoint, checkpoint) == message  # the ranks refuse it the same way


def test_a_symlinked_shard_is_refused(run_dir: Path, tmp_path: Path) -> None:
    checkpoint = step(run_dir, 40)
    elsewhere = tmp_path / "elsewhere.pt"
    shutil.move(checkpoint / SHARD, elsewhere)  # the very same bytes: the hash would pass
    (checkpoint / SHARD).symlink_to(elsewhere)
    expected = f"checkpoint {checkpoint}: {SHARD}: a symbolic link: refused"
    assert refusal(verify, checkpoint).startswith(expected)
    assert refusal(Checkpoint(checkpoint).rank_state, 0).startswith(expected)
    assert refusal(find_resume_checkpoint, str(checkpoint), None, False).startswith(expected)
    (checkpoint / "manifest.json").rename(tmp_path / "manifest.json")
    (checkpoint / "manifest.json").symlink_to(tmp_path / "manifest.json")
    assert refusal(Checkpoint, checkpoint).startswith(
        f"checkpoint {checkpoint}: manifest.json: a symbolic link: refused")


def _within(seconds: float, call: Any, *args: Any) -> BaseException | None:
    """What `call(*args)` raised, failing the test if it has not returned within `seconds`."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            call(*args)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"{call.__qualname__} blocked for {seconds} s"
    return outcome[0]


def test_a_fifo_in_place_of_a_shard_or_manifest_is_refused_at_once(run_dir: Path) -> None:
    checkpoint, model = step(run_dir, 40), meta_model()
    (checkpoint / SHARD).unlink()
    os.mkfifo(checkpoint / SHARD)
    started = time.monotonic()
    for call, args in ((verify, (checkpoint, model)), (Checkpoint(checkpoint).rank_state, (0,)),
                       (find_resume_checkpoint, (str(checkpoint), None, False))):
        error = _within(10, call, *args)
        assert isinstance(error, CheckpointError)
        assert str(error) == (f"checkpoint {checkpoint}: {SHARD}: not a regular file (a FIFO): "
                              f"refused")
    checkpoint = step(run_dir, 20)
    (checkpoint / "manifest.json").unlink()
    os.mkfifo(checkpoint / "manifest.json")
    error = _within(10, Checkpoint, checkpoint)
    assert str(error).endswith("manifest.json: not a regular file (a FIFO): refused")
    assert time.monotonic() - started < 5


def test_auto_falls_back_past_damaged_checkpoints_and_says_why(run_dir: Path) -> None:
    newest, older = step(run_dir, 40), step(run_dir, 20)
    os.truncate(newest / SHARD, 100)
    found, notes = verify_resume("auto", run_dir / "checkpoints", meta_model())
    assert found == older
    assert notes == [f"skipped checkpoints/step-00000040: {SHARD}: truncated: 100 of "
                     f"{(older / SHARD).stat().st_size} bytes"]
    assert find_resume_checkpoint("auto", run_dir / "checkpoints") == (found, notes)  # rank 0
    # named explicitly, the damaged checkpoint is refused: no fallback
    assert refusal(verify, newest).startswith(f"checkpoint {newest}: {SHARD}: truncated")
    assert refusal(verify, run_dir).startswith(f"checkpoint {newest}: {SHARD}: truncated")
    # every checkpoint damaged: refused, each named with its reason (a fresh start would
    # replace the run they record), on the head and on the ranks alike
    (older / "manifest.json").write_text("[]")
    expected = (f"no checkpoint of {run_dir / 'checkpoints'} verifies "
                f"({notes[0].removeprefix('skipped ')}; checkpoints/step-00000020: manifest.json: "
                f"not a JSON object): starting afresh would replace the run they record; repair "
                f"or move them, or start the new run in another hydra.run.dir")
    assert refusal(verify_resume, "auto", run_dir / "checkpoints", meta_model()) == expected
    assert refusal(find_resume_checkpoint, "auto", run_dir / "checkpoints") == expected
    # no complete checkpoint at all: nothing to lose there, a fresh start
    assert find_resume_checkpoint("auto", run_dir / "nothing") == (None, [])


def _start(run_dir: Path, resume: str, *overrides: str) -> Any:
    """`start_or_resume` as a rank of a 1 x 1 run in `run_dir` calls it."""
    run = run_config(*overrides)
    grid = ProcessGrid(1, 1)
    model = parallel_model(run)
    return start_or_resume(resume, 100, RunDir(run_dir), grid, model, SynchronousSGD,
                           lambda: SynchronousSGD(model, grid=grid, total_steps=100,
                                                  momentum=0.9))[1]


def test_the_ranks_resume_from_the_checkpoint_the_head_verified(run_dir: Path) -> None:
    os.truncate(step(run_dir, 40) / SHARD, 100)
    head, _ = verify_resume("auto", run_dir / "checkpoints", meta_model())
    start = _start(run_dir, "auto")
    assert start.checkpoint_path == head == step(run_dir, 20) and start.step == 20
    with pytest.raises(StepFailure) as caught:  # named: refused on the ranks too, one line
        _start(run_dir, str(step(run_dir, 40)))
    assert str(caught.value).startswith(f"cannot resume: checkpoint {step(run_dir, 40)}: "
                                        f"{SHARD}: truncated")
    with pytest.raises(StepFailure) as caught:  # another model, on the ranks
        _start(run_dir, str(step(run_dir, 20)), "model.hidden=[48,16]")
    assert "1.weight has shape [32, 64] in the checkpoint and [48, 64]" in str(caught.value)


def test_a_shard_changed_after_the_heads_check_is_caught_where_it_is_loaded(
        run_dir: Path) -> None:
    """The ranks hash the very bytes they unpickle: a shard replaced between the head's check
    and the load (here: a good shard of another step, renamed in) is refused."""
    checkpoint = step(run_dir, 40)
    assert verify(checkpoint) == (checkpoint, [])
    shutil.copy(step(run_dir, 20) / SHARD, checkpoint / SHARD)
    assert refusal(Checkpoint(checkpoint).rank_state, 0) == (
        f"checkpoint {checkpoint}: {SHARD}: sha256 mismatch (damaged or altered since written)")


def test_a_format_1_checkpoint_loads_with_a_note_that_nothing_was_verified(run_dir: Path) -> None:
    def downgrade(manifest: dict) -> None:
        manifest["format"] = 1
        del manifest["shards"]

    checkpoint = step(run_dir, 40)
    rewrite_manifest(checkpoint, downgrade)
    note = ("checkpoints/step-00000040: format 1 (written before shard hashes): no hashes, its "
            "contents are not verified")
    assert verify(checkpoint) == (checkpoint, [note])
    assert verify_resume("auto", run_dir / "checkpoints", meta_model()) == (checkpoint, [note])
    assert _start(run_dir, "auto").step == 40
    # every check but the hash still applies: a truncated format-1 shard does not unpickle
    rewrite_manifest(step(run_dir, 20), downgrade)
    os.truncate(step(run_dir, 20) / SHARD, 1000)
    assert refusal(verify, step(run_dir, 20)).startswith(
        f"checkpoint {step(run_dir, 20)}: {SHARD}: not a readable shard (RuntimeError: "
        f"PytorchStreamReader failed reading zip archive")


NASTY_NAMES = ["run (1)", "it's mine", 'say "hi"', "a=b,c", "$HOME and ${oops}", "x\\${y}",
               "trailing\\", "[1, 2]", "{a: b}", "q\\'uote", "tab\tand\nnewline", "ünï cödé",
               "%s ~ * ? ; & | < > ` #", "null", "1", "${a:b}", '\\"\\']


@pytest.mark.parametrize("name", NASTY_NAMES)
def test_the_resume_command_pastes_into_a_shell_for_any_directory_name(tmp_path: Path,
                                                                       name: str) -> None:
    """The printed command, split as a shell splits it, parses with Hydra's override grammar
    and composes to exactly the directory (OmegaConf's `${...}` included)."""
    run_dir = tmp_path / name
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(
        "- model.hidden=[64,32]\n- trainer.resume=old\n- hydra.run.dir=old\n")
    words = shlex.split(resume_command(run_dir))
    assert words[:3] == ["python", "-m", "runner"]
    assert words[3:] == ["model.hidden=[64,32]", words[4], "trainer.resume=auto"]
    overrides = OverridesParser.create().parse_overrides(words[3:])
    assert overrides[1].key_or_group == "hydra.run.dir"
    # the parsed value is the name, once OmegaConf has read it (`\${` is its escape of `${`)
    assert OmegaConf.create({"dir": overrides[1].value()}).dir == str(run_dir)
    cfg = compose(words[3:], with_hydra=True)
    assert OmegaConf.select(cfg, "hydra.run.dir") == str(run_dir)
    assert cfg.model.hidden == [64, 32] and cfg.trainer.resume == "auto"


@pytest.mark.parametrize("value", ["null", "1", "true", "1e3", "[1]", "a,b", "", "${x}"])
def test_a_quoted_value_stays_the_string_it_was(value: str) -> None:
    """Unquoted, Hydra would read these as None, a number, a bool, a list, a sweep, ..."""
    [override] = OverridesParser.create().parse_overrides([f"x={hydra_quoted(value)}"])
    assert OmegaConf.create({"x": override.value()}).x == value
