"""Parameter counts: ``ModelConfig.num_params`` (the closed form quoted in docs and comments)
against the parameters a built model actually holds."""
import math

import jax
import pytest
from flax import nnx

from specjax.models import PRESETS, Transformer


def _held_params(config) -> int:
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=0)))
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    return sum(math.prod(x.shape) for x in leaves)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_num_params_matches_the_built_model(name):
    assert PRESETS[name].num_params() == _held_params(PRESETS[name])


def test_untied_and_llama_counts_match():
    config = PRESETS["tiny"].replace(tie_embeddings=False, qk_norm=False, architecture="llama")
    assert config.num_params() == _held_params(config)


def test_tiny_preset_size_as_documented():
    # specjax/models/config.py describes the tiny preset as 90,496 parameters.
    assert PRESETS["tiny"].num_params() == 90_496
