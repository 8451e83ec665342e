"""Parallel plans by module name (strategies/plans/module_plan.py) against one process, in one
launch:
`mpiexec -n 4 python THIS [OUT]` (with the checks of `check_plan_vocab.py`,
`check_plan_resume.py`, `check_fsdp.py` (sharded data parallelism), `check_corpus.py` (the
conformance corpus) and `check_weights.py` (pretrained weights in, trained weights out), which
it imports: the ranks import torch and the transformers library once).

The transformers library's Llama, Phi-3 and OLMo-2 (their declared plans: Phi-3's gathered
fused projections and split inputs, `colwise_gather_output` and `rowwise_split_input`), GPT-2
and BERT (plans given) and a user's
attention block (a plan given, and one derived from its structure under model and auto; the
Llama and the block also with their norms `sequence`: Megatron-LM's sequence parallelism), in
float64, under strategy=model 2x1 (GPT-2 also 4x1) and strategy=grid 2x2:
every step's loss equals one process's to 1e-9 relative (SGD with momentum; AdamW for one
case), every final parameter piece equals the block of one process's parameter its placement
names, the pieces tile every parameter (a checkpoint loads on any grid), and the bytes rank 0
moves every step are the predicted ones.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `tests` is this checkout's, whatever else is installed

# their checks run in this launch too (one start of 4 ranks instead of four)
import check_corpus  # noqa: E402, F401
import check_fsdp  # noqa: E402, F401
import check_plan_resume  # noqa: E402, F401
import check_plan_vocab  # noqa: E402, F401
import check_weights  # noqa: E402, F401
import torch  # noqa: E402
from harness import check, make_grids, run_checks  # noqa: E402
from mpi4py import MPI  # noqa: E402
from plan_harness import (  # noqa: E402
    built,
    tagged_copy,
    train_as_one_process,
)
from torch import nn  # noqa: E402

from runner.core import ProcessGrid  # noqa: E402
from strategies import STRATEGIES, PricingContext  # noqa: E402
from strategies.plans.module_plan import DERIVED_SOURCE  # noqa: E402
from tests import plan_models  # noqa: E402

WORLD = MPI.COMM_WORLD
GRIDS = make_grids([(2, 1), (4, 1), (2, 2)])
VOCAB, T, BATCH, CLASSES = 50, 8, 8, 4
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def optimizer(params: list[nn.Parameter], name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def compare(factory: Callable[[], nn.Module], plan: dict[str, str], strategy_name: str,
            shape: tuple[int, int], classes: int | None = None, opt: str = "sgd",
            source: str | None = None) -> None:
    grid: ProcessGrid | None = GRIDS[shape]
    if grid is None:
        return
    what = f"{factory.__name__} {strategy_name} {shape[0]}x{shape[1]} {opt}"
    options: dict[str, object] = ({"pricing": PricingContext(global_batch=BATCH)}
                                  if strategy_name == "auto" else {"plan": plan})
    strategy = STRATEGIES.get(strategy_name)(bucket_cap_mb=0.004, first_bucket_mb=0.001,
                                             **options)
    seq = built(factory)
    assert strategy.check(grid.shape, BATCH) == [], what
    assert strategy.check_model(seq, (T,), grid.shape) == [], (
        what, strategy.check_model(seq, (T,), grid.shape))
    ops = strategy.predict_ops(seq, (T,), grid.shape, BATCH)
    pmodel = strategy.parallelize(tagged_copy(seq), (T,), grid)
    assert getattr(pmodel, "layouts", None), what
    if source is not None:
        assert getattr(pmodel, "plan_source", None) == source, (what, pmodel.layouts)
    gen = torch.Generator().manual_seed(9)
    x = torch.randint(1, VOCAB, (BATCH, T), generator=gen)
    y = (torch.randint(0, classes, (BATCH,), generator=gen) if classes
         else torch.randint(0, VOCAB, (BATCH, T), generator=gen))
    train_as_one_process(seq, pmodel, grid, x, y, ops, what,
                         lambda params: optimizer(params, opt))


# Llama's declared plan without its head (a vocabulary of 50 does not divide over 4 ranks)
LLAMA_BLOCKS_PLAN = {f"model.layers.*.{path}": style for path, style in (
    ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"),
    ("self_attn.v_proj", "colwise"), ("self_attn.o_proj", "rowwise"),
    ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise"))}


def llama() -> nn.Module:
    return plan_models.hf_llama(VOCAB, (T,))


def gpt2() -> nn.Module:
    return plan_models.hf_gpt2(VOCAB, (T,))


def bert() -> nn.Module:
    return plan_models.hf_bert(VOCAB, CLASSES, (T,))


def phi3() -> nn.Module:
    return plan_models.hf_phi3(VOCAB, (T,))


def olmo2() -> nn.Module:
    return plan_models.hf_olmo2(VOCAB, (T,))


def gemma() -> nn.Module:
    return plan_models.hf_gemma(VOCAB, (T,))


def user_block() -> nn.Module:
    return plan_models.UserBlockLM(VOCAB)


@check
def transformers_models_by_plan_equal_one_process() -> None:
    if not HAVE_TRANSFORMERS:
        return
    for strategy_name, shape in (("model", (2, 1)), ("grid", (2, 2))):
        compare(llama, {}, strategy_name, shape)
        compare(gpt2, plan_models.GPT2_PLAN, strategy_name, shape)
        compare(bert, plan_models.BERT_PLAN, strategy_name, shape, classes=CLASSES)
    compare(gpt2, plan_models.GPT2_PLAN, "model", (4, 1))
    compare(llama, {}, "grid", (2, 2), opt="adamw")
    # declared plans that gather outputs mid-model and split whole inputs
    compare(phi3, {}, "model", (2, 1))
    compare(phi3, {}, "grid", (2, 2))
    compare(olmo2, {}, "grid", (2, 2))
    # a head tied to the token table: one piece of one weight on each rank, both uses
    compare(gemma, {}, "model", (2, 1))
    compare(gemma, {}, "grid", (2, 2), opt="adamw")
    # GPT-2's tied head split by vocabulary, scored split, its table split with it
    compare(gpt2, {**plan_models.GPT2_PLAN, "lm_head": "vocab"}, "grid", (2, 2))
    # 4 ranks, 2 key/value heads: each held whole, each rank computing its query heads' one
    compare(llama, LLAMA_BLOCKS_PLAN, "model", (4, 1))


@check
def a_users_attention_block_by_plan_equals_one_process() -> None:
    for strategy_name, shape in (("model", (2, 1)), ("grid", (2, 2))):
        compare(user_block, plan_models.BLOCK_PLAN, strategy_name, shape)


# Megatron-LM's sequence parallelism: the norms on a rank's positions, the projections gathering
# and scattering along the sequence (a vocabulary of 50 divides over 2 ranks: the head too)
LLAMA_SEQUENCE_PLAN = {**LLAMA_BLOCKS_PLAN, "lm_head": "colwise",
                       "model.layers.*.input_layernorm": "sequence",
                       "model.layers.*.post_attention_layernorm": "sequence",
                       "model.norm": "sequence"}
BLOCK_SEQUENCE_PLAN = {**plan_models.BLOCK_PLAN, "blocks.*.norm?": "sequence", "norm": "sequence"}


@check
def sequence_parallel_plans_equal_one_process() -> None:
    for strategy_name, shape in (("model", (2, 1)), ("grid", (2, 2))):
        if HAVE_TRANSFORMERS:
            compare(llama, LLAMA_SEQUENCE_PLAN, strategy_name, shape)
        compare(user_block, BLOCK_SEQUENCE_PLAN, strategy_name, shape)
    if HAVE_TRANSFORMERS:
        compare(llama, LLAMA_SEQUENCE_PLAN, "grid", (2, 2), opt="adamw")


# strategy=domain: every weight whole, the norms and MLPs on a rank's positions, the attention
# on the gathered sequence
LLAMA_DOMAIN_PLAN = {"model.layers.*.*_layernorm": "sequence", "model.layers.*.mlp": "sequence",
                     "model.norm": "sequence"}
BLOCK_DOMAIN_PLAN = {"blocks.*.norm?": "sequence", "blocks.*.fc?": "sequence", "norm": "sequence"}


@check
def domain_plans_equal_one_process() -> None:
    for shape in ((2, 1), (2, 2)):
        if HAVE_TRANSFORMERS:
            compare(llama, LLAMA_DOMAIN_PLAN, "domain", shape)
        compare(user_block, BLOCK_DOMAIN_PLAN, "domain", shape)
    if HAVE_TRANSFORMERS:
        compare(llama, LLAMA_DOMAIN_PLAN, "domain", (2, 2), opt="adamw")
    compare(user_block, BLOCK_DOMAIN_PLAN, "domain", (2, 1), opt="adamw")


def normed_classifier() -> nn.Module:
    return plan_models.NormedClassifier(VOCAB, CLASSES)


@check
def a_batch_norm_under_a_plan_takes_the_whole_batchs_statistics() -> None:
    # on grid 2x2 a batch group holds half the batch: its statistics come from both groups
    for strategy_name, shape in (("model", (2, 1)), ("grid", (2, 2))):
        compare(normed_classifier, plan_models.NORMED_PLAN, strategy_name, shape,
                classes=CLASSES)


@check
def a_plan_derived_from_the_module_structure_equals_one_process() -> None:
    # no plan given or declared: the block's embedding, attention and MLP by derivation; under
    # auto 2x2 the derived plan is the one strategy that runs it there
    compare(user_block, {}, "model", (2, 1), source=DERIVED_SOURCE)
    compare(user_block, {}, "auto", (2, 2), source=DERIVED_SOURCE)


if __name__ == "__main__":
    run_checks()
