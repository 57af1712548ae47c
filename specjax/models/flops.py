"""Matmul FLOP counts of the transformer (PaLM, appendix B: ``2 N`` per token forward, ``6 N``
forward + backward, and ``4 L H Dh T`` forward for attention over ``T`` positions).

These are *model* FLOPs: the arithmetic a program must do, counted from the configuration, the
numerator of an MFU. The embedding lookup is a gather, not a matmul, and is not counted; the LM
head is. Attention is counted over the whole context a query is scored against (the masked
half of a causal score matrix is computed too). Norms, softmax and element-wise work are left
out, as in the paper.

The serving engine's programs are counted from them too: the target's forward over the tokens a
step feeds (its LM head only at the rows whose logits are used) plus each drafter's own
``propose_flops`` / ``prefill_flops`` / ``commit_flops`` (:mod:`specjax.aot.programs`).

The training tasks count a step from these (``model_flops_per_row`` of
:mod:`specjax.training.lm_task` and :mod:`specjax.training.drafter_task`, the latter with each
drafter's own ``train_flops``); the trainer logs model TFLOP/s and MFU with them and the
pre-flight (:mod:`specjax.aot`) reports MFU.
"""
from __future__ import annotations

from specjax.models.config import ModelConfig

__all__ = ["block_matmul_params", "matmul_params", "attention_flops_per_query",
           "forward_flops_per_token", "lm_head_flops_per_row"]


def block_matmul_params(c: ModelConfig) -> int:
    """Parameters of one block that multiply activations: q / k / v / o projections and the
    SwiGLU MLP's three matrices."""
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    return attn + 3 * c.hidden_size * c.intermediate_size


def matmul_params(c: ModelConfig) -> int:
    """Parameters that multiply activations per token: every block plus the LM head (the lookup
    table is not a matmul; a tied head counts once, as the head)."""
    return c.num_layers * block_matmul_params(c) + c.vocab_size * c.hidden_size


def attention_flops_per_query(c: ModelConfig, context: int) -> float:
    """Forward FLOPs of one query's scores and weighted values over ``context`` positions, in
    every layer of ``c``: ``4 L H Dh context``."""
    return 4 * c.num_layers * c.num_heads * c.head_dim * context


def forward_flops_per_token(c: ModelConfig, context: int) -> float:
    """Forward FLOPs of one token attending to ``context`` positions."""
    return 2 * matmul_params(c) + attention_flops_per_query(c, context)


def lm_head_flops_per_row(c: ModelConfig) -> float:
    """Forward FLOPs of the LM head at one position: ``2 V d``."""
    return 2 * c.vocab_size * c.hidden_size
