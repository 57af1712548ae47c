"""Result types shared by the verifiers (:mod:`specjax.verify`) and their kernels
(:mod:`pallas_kernels`): a small leaf module, so that kernels never import the math that
dispatches to them."""
from __future__ import annotations

from typing import NamedTuple

import jax


class VerifyOutput(NamedTuple):
    num_accepted: jax.Array  # int32 [B]: accepted draft tokens, 0..num_draft[b]
    tokens: jax.Array  # int32 [B, K+1]: tokens[b, :num_accepted[b]+1] are emitted; the rest are -1
