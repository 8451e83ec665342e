"""Weights in and out through the command line: a directory `save_pretrained` wrote is
fine-tuned (`model.weights=DIR`, the model from its config.json) under `strategy=fsdp` on 2 x 2
ranks, each rank reading only its blocks, and handed back with `python -m runner.export`, which
`from_pretrained` loads; every bad input is one line and exit 2 before any rank starts (the
equality checks with real ranks are tests/mpi/check_weights.py's)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli, run_cli_together, run_module

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 48
DATA = ["dataset=tokens", f"dataset.vocab_size={VOCAB}", "dataset.samples=160",
        "dataset.seq_len=8", "trainer.batch_size=16"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama written by `save_pretrained`, random weights."""
    path = tmp_path_factory.mktemp("weights") / "llama"
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=32, max_position_embeddings=16,
        bos_token_id=0, eos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def one_line_error(result: object) -> str:
    """The refusal of a run that ended with exit 2: its one line."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])  # type: ignore[attr-defined]
    lines = [x for x in result.stderr.strip().splitlines() if x.strip()]  # type: ignore[attr-defined]
    assert len(lines) == 1, lines
    assert "Traceback" not in result.stderr  # type: ignore[attr-defined]
    return lines[0]


def test_a_saved_llama_is_fine_tuned_on_2x2_ranks_and_exported(llama: Path,
                                                                 tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = run_cli(f"model.weights={llama}", *DATA, "strategy=fsdp", "grid.pc=2",
                     "trainer.steps=3", f"hydra.run.dir={run}")  # its checkpoint: at the end
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = (run / "config.yaml").read_text()
    assert "name: pretrained" in recorded and f"weights: {llama}" in recorded
    file_bytes = (llama / "model.safetensors").stat().st_size
    logs = "".join(path.read_text() for path in (run / "logs").glob("*"))
    read = [int(m) for m in re.findall(r"model\.weights: (\d+) bytes", logs)]
    # each rank of fsdp 2 x 2 reads its blocks: about a quarter of the file each
    assert len(read) == 4 and all(0 < r < 0.6 * file_bytes for r in read), read

    out = tmp_path / "exported"
    exported = run_module("runner.export", str(run), "--to", str(out))
    assert exported.returncode == 0, exported.stderr
    assert "verified" in exported.stdout
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    original = transformers.AutoModelForCausalLM.from_pretrained(llama).state_dict()
    trained = model.state_dict()
    assert original.keys() == trained.keys()
    assert any(not torch.equal(trained[k], original[k]) for k in original)  # it trained

    again = run_module("runner.export", str(run), "--to", str(out))
    assert "already holds a model" in one_line_error(again)
    forced = run_module("runner.export", str(run), "--to", str(out), "--force",
                        "--dtype", "bfloat16")
    assert forced.returncode == 0, forced.stderr
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    missing_step = run_module("runner.export", str(run), "--step", "7", "--to",
                              str(tmp_path / "other"))
    assert "no complete checkpoint of step 7" in one_line_error(missing_step)

    shard = next((run / "checkpoints" / "step-00000003").glob("rank-*.pt"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    damaged = run_module("runner.export", str(run), "--to", str(tmp_path / "from_damaged"))
    assert "sha256 mismatch" in one_line_error(damaged)
    assert not (tmp_path / "from_damaged").exists()


class Evil:
    """A pickled object that would run a command when loaded without `weights_only`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def variant(llama: Path, root: Path, name: str) -> Path:
    """A copy of the Llama's directory to spoil."""
    path = root / name
    shutil.copytree(llama, path)
    return path


def spoiled_directories(llama: Path, root: Path) -> dict[str, tuple[Path, list[str], str]]:
    """name: (weights, extra overrides, what the one line must say)."""
    tensors = safetensors_torch.load_file(llama / "model.safetensors")
    cases: dict[str, tuple[Path, list[str], str]] = {}
    cases["missing"] = (root / "nowhere", [], "no such file or directory")
    cases["shape"] = (llama, ["model.intermediate_size=40"], "has shape [32, 16] in the "
                      "weights and [40, 16] in the model")

    def rewritten(name: str, changed: dict[str, torch.Tensor]) -> Path:
        path = variant(llama, root, name)
        safetensors_torch.save_file(changed, path / "model.safetensors", {"format": "pt"})
        return path

    cases["unexpected"] = (rewritten("unexpected", {**tensors, "extra.weight": torch.ones(2)}),
                           [], "unexpected in the weights: extra.weight")
    less = dict(tensors)
    del less["model.norm.weight"]
    cases["absent"] = (rewritten("absent", less), [], "not in the weights: model.norm.weight")
    cases["dtype"] = (rewritten("dtype", {**tensors, "model.norm.weight": torch.ones(
        16, dtype=torch.int32)}), [], "model.norm.weight is int32 in the weights and float32 "
        "in the model: it cannot be cast")
    truncated = variant(llama, root, "truncated")
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate((truncated / "model.safetensors").stat().st_size - 100)
    cases["truncated"] = (truncated, [], "truncated")
    corrupted = variant(llama, root, "corrupted")
    data = bytearray((corrupted / "model.safetensors").read_bytes())
    data[8:40] = b"\x00\xff" * 16
    (corrupted / "model.safetensors").write_bytes(bytes(data))
    cases["corrupted"] = (corrupted, [], "not a safetensors file")
    outside = variant(llama, root, "outside")
    (outside / "model.safetensors").rename(root / "elsewhere.safetensors")
    (outside / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "../elsewhere.safetensors" for k in tensors}}))
    cases["outside"] = (outside, [], "not a file of the index's own directory")
    pickled = variant(llama, root, "pickled")
    (pickled / "model.safetensors").unlink()
    torch.save({"model.norm.weight": Evil(root / "ran")}, pickled / "pytorch_model.bin")
    cases["pickled"] = (pickled, [], "refused")
    renamed = variant(llama, root, "renamed")
    torch.save(tensors, renamed / "model.safetensors")
    cases["renamed"] = (renamed, [], "a torch.save file, not safetensors")
    return cases


def test_bad_weights_are_one_line_each_before_any_rank_starts(llama: Path,
                                                              tmp_path: Path) -> None:
    cases = spoiled_directories(llama, tmp_path)
    jobs = [[f"model.weights={path}", *extra, *DATA, "grid.pr=2", "grid.pc=2",
             f"hydra.run.dir={tmp_path / ('run_' + name)}"]
            for name, (path, extra, _) in cases.items()]
    for (name, (path, _, words)), result in zip(cases.items(), run_cli_together(*jobs),
                                                strict=True):
        line = one_line_error(result)
        assert words in line and f"model.weights={path}" in line, (name, line)
        assert not (tmp_path / f"run_{name}" / "logs").exists(), name  # no rank started
    assert not (tmp_path / "ran").exists()  # the pickle's command never ran


def test_an_elastic_averaging_checkpoint_exports_its_centre_as_one_file(tmp_path: Path) -> None:
    """A model of gridrun's own zoo (no transformers configuration): one safetensors file, the
    centre variable the replicas agree on, tensor for tensor as the checkpoint holds it."""
    run = tmp_path / "run"
    result = run_cli("model=mlp", "dataset=digits", "optimizer=sync_easgd", "grid.pr=1",
                     "grid.pc=2", "trainer.steps=2", "trainer.checkpoint_every=2",
                     f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "mlp.safetensors"
    exported = run_module("runner.export", str(run), "--to", str(out))
    assert exported.returncode == 0, exported.stderr
    tensors = safetensors_torch.load_file(out)
    shard = torch.load(run / "checkpoints" / "step-00000002" / "rank-00000.pt",
                       weights_only=True)
    centre = {key.split("/")[2]: value for key, value in shard.items()
              if key.startswith("centre/")}
    assert tensors.keys() == centre.keys() and len(tensors) == 6
    assert all(torch.equal(tensors[name], centre[name]) for name in tensors)
    own = {key.split("/")[2]: value for key, value in shard.items()
           if key.startswith("model/0/")}
    assert any(not torch.equal(own[name], centre[name]) for name in centre)  # not a replica's


def test_a_model_of_the_zoo_starts_from_a_safetensors_file_or_a_state_dict(
        tmp_path: Path) -> None:
    """`model=mlp model.weights=FILE` (the key is every model's, though mlp's YAML has no such
    key): the classifier's weights zero, so the first loss is ln 10 whichever file it read; a
    file alone, without a model named, is one line."""
    from runner.zoo.models import mlp

    state = {k: v.clone() for k, v in mlp((1, 8, 8), 10).state_dict().items()}
    last = sorted(k for k in state if k.endswith(".weight"))[-1]
    state[last].zero_()
    state[last.replace("weight", "bias")].zero_()
    safetensors_torch.save_file(state, tmp_path / "mlp.safetensors")
    torch.save(state, tmp_path / "mlp.pt")
    jobs = [["model=mlp", f"model.weights={tmp_path / name}", "grid.pr=1", "grid.pc=1",
             "trainer.steps=1", f"hydra.run.dir={tmp_path / ('run_' + name)}"]
            for name in ("mlp.safetensors", "mlp.pt")]
    jobs.append([f"model.weights={tmp_path / 'mlp.safetensors'}", "grid.pr=1", "grid.pc=1",
                 f"hydra.run.dir={tmp_path / 'run_alone'}"])
    *loaded, alone = run_cli_together(*jobs)
    for name, result in zip(("mlp.safetensors", "mlp.pt"), loaded, strict=True):
        assert result.returncode == 0, result.stderr[-2000:]
        first = json.loads((tmp_path / f"run_{name}" / "metrics.jsonl").read_text()
                           .splitlines()[0])
        assert abs(first["loss"] - math.log(10)) < 1e-6, (name, first)
    assert "does not say which model it is of" in one_line_error(alone)
