"""Weights in and out with real ranks (`runner.weights`), in check_plans.py's launch:
`mpiexec -n 4 python check_plans.py [OUT]` (or this script alone).

- Round trip: the transformers library's Llama, GPT-2 and ViT, made from small configs with
  random weights and written by `save_pretrained`, are started from (`model.weights=DIR`, the
  model from the directory's config.json) under `data` 1x2, `grid` 2x2 (Llama's declared plan,
  the others' given), `fsdp` 1x4 (stage 3) and `model` 2x1 by plan, Llama also under `domain`
  2x1 and `auto` 2x2, each rank reading only its blocks; a checkpoint of step 0 is exported
  (`runner.weights.export`) and `from_pretrained` loads it, no name missing or left over, every
  tensor bit-identical to the original's. Llama's weights saved in bf16 load into float32
  parameters and export as bf16 to the same bits.
- Fine-tune: GPT-2 from its weights, 20 float64 steps under `grid` 2x2 and `fsdp` 2x2 (plans),
  gives the losses of one process started from the same weights to 1e-9 with the predicted
  bytes; the 2x2 `fsdp` run exports at its end (`trainer.export`), and the exported model's
  validation loss, computed by the transformers library from its logits, is the run's own
  evaluation of it to 1e-6.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `tests` is this checkout's, whatever else is installed

import torch  # noqa: E402
from harness import (  # noqa: E402
    assert_one_process,
    check,
    make_grids,
    one_process_losses,
    wait_politely,
)
from mpi4py import MPI  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from tests import plan_models, plan_vit_models  # noqa: E402

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/check_weights") / "weights"
WORLD = MPI.COMM_WORLD
GRIDS = make_grids([(1, 2), (2, 2), (1, 4), (2, 1)])
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
VOCAB, T = 48, 8
TOKENS = {"name": "tokens", "vocab_size": VOCAB, "seq_len": T, "classes": 4, "samples": 64,
          "val_fraction": 0.25, "seed": 0}
DIGITS = {"name": "digits", "val_fraction": 0.2}
GPT2_PLAN = plan_models.GPT2_PLAN
VIT_PLAN = plan_vit_models.HF_VIT_PLAN
# (strategy, pr, pc, needs the model's plan): the layouts a round trip goes through
LAYOUTS = [("data", 1, 2, False), ("grid", 2, 2, True), ("fsdp", 1, 4, False),
           ("model", 2, 1, True)]
# Llama's also: strategy=domain (its norms and MLPs on a rank's positions, weights whole) and
# strategy=auto (a layout per layer)
LLAMA_LAYOUTS = [*LAYOUTS, ("domain", 2, 1, True), ("auto", 2, 2, False)]
LLAMA_DOMAIN_PLAN = {"model.layers.*.*_layernorm": "sequence",
                     "model.layers.*.mlp": "sequence", "model.norm": "sequence"}


@functools.cache
def saved_models() -> dict[str, Path]:
    """Llama, GPT-2 and ViT written by `save_pretrained` (rank 0), random weights, dropout 0."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        ViTConfig,
        ViTForImageClassification,
    )

    dirs = {name: OUT / "pretrained" / name for name in ("llama", "llama_bf16", "gpt2", "vit")}
    if WORLD.Get_rank() == 0:
        torch.manual_seed(5)
        llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, intermediate_size=32, max_position_embeddings=16,
            bos_token_id=0, eos_token_id=0))
        llama.save_pretrained(dirs["llama"])
        llama.to(torch.bfloat16).save_pretrained(dirs["llama_bf16"])
        GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=4, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        ).save_pretrained(dirs["gpt2"])
        ViTForImageClassification(ViTConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
            image_size=8, patch_size=4, num_channels=1, num_labels=10,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        ).save_pretrained(dirs["vit"])
    WORLD.Barrier()
    return dirs


def run_config(weights: Path, strategy: str, pr: int, pc: int, plan: dict[str, str] | None,
               dataset: dict[str, Any], steps: int = 1, dtype: str = "float32",
               export: bool = False) -> dict[str, Any]:
    return {
        "seed": 3, "grid": {"pr": pr, "pc": pc},
        "trainer": {"steps": steps, "batch_size": 8, "log_every": 1, "eval_every": None,
                    "threads": None, "dtype": dtype, "export": export},
        "model": {"name": "pretrained", "weights": str(weights)}, "dataset": dataset,
        "strategy": {"name": strategy, **({"plan": plan} if plan else {})},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "launcher": {"command": None, "args": []},
        "debug": {"fail_at_step": None},
    }


def checkpoint_at_start(config: dict[str, Any], run_dir: Path, grid: Any) -> Path:
    """The run built as a rank builds it (the weights loaded, each rank its blocks) and its
    checkpoint of step 0 written: a run of no steps."""
    from runner.cli.validation import validate
    from runner.records.rundir import RunDir
    from runner.training.loop import build_training

    cfg = OmegaConf.create(config)
    directory = RunDir(run_dir)
    if grid.rank == 0:
        directory.create(cfg)
    grid.world.barrier()
    training = build_training(validate(cfg, world_size=grid.size), directory, grid)
    training.checkpoint(0)
    training.close()
    return directory.checkpoints / "step-00000000"


def assert_same_model(original: Path, exported: Path, what: str) -> None:
    """`from_pretrained` loads the export with nothing missing or left over, and every
    tensor of the exported files is the original file's, bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(exported)
    model_class = getattr(__import__("transformers"), config.architectures[0])
    _, info = model_class.from_pretrained(exported, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys",
                                         "mismatched_keys")), (what, info)
    want = load_file(original / "model.safetensors")
    got: dict[str, torch.Tensor] = {}
    for file in sorted(exported.glob("*.safetensors")):
        got.update(load_file(file))
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (what, name)


def round_trip(name: str, weights: Path, plans: dict[str, dict[str, str] | None],
               dataset: dict[str, Any], layouts: list[tuple[str, int, int, bool]] = LAYOUTS,
               dtype: torch.dtype | None = None) -> None:
    """Each layout loads the weights and exports step 0 (as `dtype`: None, as held), which
    must be the original. `plans`: the plan each strategy that needs one is given."""
    from runner.weights.export import ExportRequest, export_checkpoint

    for strategy, pr, pc, planned in layouts:
        grid = GRIDS[pr, pc]
        if grid is None:
            continue
        what = f"{name} {strategy} {pr}x{pc}"
        config = run_config(weights, strategy, pr, pc, plans.get(strategy) if planned else None,
                            dataset)
        checkpoint = checkpoint_at_start(config, OUT / f"{name}_{strategy}", grid)
        if grid.rank == 0:
            out = OUT / f"{name}_{strategy}_export"
            export_checkpoint(ExportRequest(checkpoint, out, dtype, max_shard_bytes=8_000))
            assert len(list(out.glob("*.safetensors"))) > 1, what  # sharded, with an index
            assert_same_model(weights, out, what)
    wait_politely()


@check
def weights_round_trip_under_every_layout() -> None:
    if not HAVE_TRANSFORMERS:
        return
    dirs = saved_models()
    round_trip("llama", dirs["llama"], {"domain": LLAMA_DOMAIN_PLAN}, TOKENS, LLAMA_LAYOUTS)
    round_trip("gpt2", dirs["gpt2"], {"grid": GPT2_PLAN, "model": GPT2_PLAN}, TOKENS)
    round_trip("vit", dirs["vit"], {"grid": VIT_PLAN, "model": VIT_PLAN}, DIGITS)
    # bf16 weights into float32 parameters, exactly; exported as bf16, the original bits
    round_trip("llama_bf16", dirs["llama_bf16"], {}, TOKENS, LAYOUTS[:1], torch.bfloat16)


def exported_val_loss(exported: Path) -> float:
    """The validation loss of the exported model, by the transformers library alone."""
    from transformers import GPT2LMHeadModel

    from runner.config.schema import Plugin
    from runner.training.assembly import build_dataset

    model = GPT2LMHeadModel.from_pretrained(exported, dtype=torch.float64).eval()
    options = {k: v for k, v in TOKENS.items() if k != "name"}
    data = build_dataset(Plugin("tokens", options), "next_token").load()
    with torch.no_grad():
        logits = model(data.val_x).logits
    return float(torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), data.val_y.reshape(-1)))


@check
def fine_tuning_from_weights_is_one_process() -> None:
    if not HAVE_TRANSFORMERS:
        return
    from harness import train_run

    weights = saved_models()["gpt2"]
    steps = 20

    def config(strategy: str, pr: int, pc: int, export: bool = False) -> dict[str, Any]:
        plan = GPT2_PLAN if pr > 1 else None
        return run_config(weights, strategy, pr, pc, plan, TOKENS, steps, "float64", export)

    want = one_process_losses({"one": (config("data", 1, 1), OUT / "tune_one")})["one"]
    grid = GRIDS[2, 2]
    for strategy in ("grid", "fsdp"):
        run = train_run(config(strategy, 2, 2, export=strategy == "fsdp"),
                        OUT / f"tune_{strategy}", grid)
        if grid.rank == 0:
            assert_one_process(run, want, 1e-9, f"gpt2 fine-tuned under {strategy} 2x2")
    if grid.rank == 0:
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        evaluated = [m["loss"] for m in lines if m.get("split") == "val"][-1]
        exported = exported_val_loss(run / "export")
        assert abs(exported - evaluated) <= 1e-6 * abs(evaluated), (exported, evaluated)


if __name__ == "__main__":
    from harness import run_checks

    run_checks()
