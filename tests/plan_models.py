"""Models split by a parallel plan by module name (`strategies.plans.module_plan`), and their plans:
the transformers library's Llama (its declared plan), GPT-2 and BERT (plans given), and a
user's own attention block. Tiny, built from configs (no weights downloaded), dropout 0 (the
equivalences with dropout are in tests/test_module_plan.py and tests/test_whole_batch.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GPT2_PLAN = {"transformer.h.*.attn.c_attn": "fused_qkv", "transformer.h.*.attn.c_proj": "rowwise",
             "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
BERT_PLAN = {"bert.encoder.layer.*.attention.self.query": "colwise",
             "bert.encoder.layer.*.attention.self.key": "colwise",
             "bert.encoder.layer.*.attention.self.value": "colwise",
             "bert.encoder.layer.*.attention.output.dense": "rowwise",
             "bert.encoder.layer.*.intermediate.dense": "colwise",
             "bert.encoder.layer.*.output.dense": "rowwise",
             "bert.embeddings.word_embeddings": "vocab"}
BLOCK_PLAN = {"embed": "vocab", "blocks.*.attn.qkv": "fused_qkv", "blocks.*.attn.out": "rowwise",
              "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise", "head": "colwise"}


class RMSNorm(nn.Module):
    """Llama's RMSNorm in the input's dtype (the library's computes in float32 whatever the
    dtype, so two float64 runs would differ by float32's rounding where inputs differ by
    float64's)."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _own_norms(model: nn.Module, norm_class: str, norm: type[nn.Module] | None = None,
               eps: str = "variance_epsilon") -> nn.Module:
    """`model` with each of its `norm_class` norms computing in the model's dtype (`norm`, by
    default `RMSNorm`, given the library's weight and its `eps` attribute)."""
    found = [(name, module) for name, module in model.named_modules()
             if type(module).__name__ == norm_class]
    for name, module in found:
        model.set_submodule(name, (norm or RMSNorm)(module.weight, getattr(module, eps)))
    return model


def hf_llama(vocab_size: int, input_shape: tuple[int, ...], key_value_heads: int = 2
             ) -> nn.Module:
    """The transformers library's Llama: 4 query heads sharing `key_value_heads` key/value
    heads (4: it splits over 4 ranks); its norms computed in the model's dtype (`RMSNorm`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=key_value_heads,
                         intermediate_size=32,
                         max_position_embeddings=max(16, input_shape[0]), bos_token_id=0,
                         eos_token_id=0, pad_token_id=None)
    return _own_norms(LlamaForCausalLM(config), "LlamaRMSNorm")


hf_llama.objective = "next_token"  # type: ignore[attr-defined]


def hf_phi3(vocab_size: int, input_shape: tuple[int, ...]) -> nn.Module:
    """The transformers library's Phi-3, by its declared plan: fused q/k/v and gate/up
    projections `colwise_gather_output`, their outputs' readers `rowwise_split_input`; its
    head untied (a tied head is a plan of its own)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                        max_position_embeddings=max(16, input_shape[0]), bos_token_id=0,
                        eos_token_id=0, pad_token_id=None, tie_word_embeddings=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    return _own_norms(Phi3ForCausalLM(config), "Phi3RMSNorm")


hf_phi3.objective = "next_token"  # type: ignore[attr-defined]


def hf_olmo2(vocab_size: int, input_shape: tuple[int, ...]) -> nn.Module:
    """The transformers library's OLMo-2, by its declared plan: q/k/v gathered
    (`colwise_gather_output`: its q and k norms read all heads), o `rowwise_split_input`, the
    MLP `colwise`/`rowwise`."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    config = Olmo2Config(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                         max_position_embeddings=max(16, input_shape[0]), bos_token_id=0,
                         eos_token_id=0, pad_token_id=None, tie_word_embeddings=False)
    return _own_norms(Olmo2ForCausalLM(config), "Olmo2RMSNorm")


hf_olmo2.objective = "next_token"  # type: ignore[attr-defined]


class OnePlusRMSNorm(nn.Module):
    """Gemma's RMSNorm (a scale of 1 + weight) in the input's dtype (`RMSNorm`'s reason)."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def hf_gemma(vocab_size: int, input_shape: tuple[int, ...]) -> nn.Module:
    """The transformers library's Gemma, its head tied to its token table (one weight): its
    declared plan splits the head, and the table with it, by vocabulary."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                         intermediate_size=32, max_position_embeddings=max(16, input_shape[0]),
                         bos_token_id=0, eos_token_id=0, pad_token_id=None,
                         tie_word_embeddings=True)
    return _own_norms(GemmaForCausalLM(config), "GemmaRMSNorm", OnePlusRMSNorm, "eps")


hf_gemma.objective = "next_token"  # type: ignore[attr-defined]


def hf_gpt2(vocab_size: int, input_shape: tuple[int, ...]) -> nn.Module:
    """The transformers library's GPT-2, 4 heads (it splits over 2 or 4 ranks)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=max(16, input_shape[0]), n_embd=16,
                        n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


hf_gpt2.objective = "next_token"  # type: ignore[attr-defined]


def hf_bert(vocab_size: int, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """The transformers library's BERT for sequence classification (a padding row, id 0)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=max(16, input_shape[0]), num_labels=num_classes,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


class HeadsAttention(nn.Module):
    """A user's attention: a fused qkv Linear, its head count an attribute."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (part.reshape(b, t, self.heads, -1).transpose(1, 2)
                   for part in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class UserBlock(nn.Module):
    """Pre-norm attention and MLP, each a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = HeadsAttention(dim, heads)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class UserBlockLM(nn.Module):
    """A user's causal language model of `UserBlock`s (its plan: `BLOCK_PLAN`)."""

    objective = "next_token"

    def __init__(self, vocab_size: int, input_shape: tuple[int, ...] = (16,), dim: int = 16,
                 heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.randn(input_shape[0], dim) * 0.02)
        self.blocks = nn.ModuleList(UserBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class FixedHeadsAttention(HeadsAttention):
    """An attention that reads its head count under a name gridrun does not know."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__(dim, heads)
        self.local_heads = heads


class FixedHeadsLM(UserBlockLM):
    """`UserBlockLM` whose attention reads its head count as `local_heads`."""

    def __init__(self, vocab_size: int, input_shape: tuple[int, ...] = (16,),
                 heads: int = 4) -> None:
        super().__init__(vocab_size, input_shape, heads=heads)
        for block in self.blocks:
            assert isinstance(block, UserBlock)
            block.attn = FixedHeadsAttention(16, heads)


class NormedClassifier(nn.Module):
    """Token ids to classes through a BatchNorm on the pooled features and a planned MLP: the
    BatchNorm must take the whole batch's statistics, though a batch group holds part of it."""

    def __init__(self, vocab_size: int, num_classes: int, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(tokens).mean(dim=1))
        return self.head(x + self.fc2(F.gelu(self.fc1(x))))


NORMED_PLAN = {"embed": "vocab", "fc1": "colwise", "fc2": "rowwise"}
