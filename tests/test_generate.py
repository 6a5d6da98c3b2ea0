"""Generation with a key/value cache equals the model's full forward pass, step by step."""
import jax
import numpy as np
import pytest

from mscale_jax import generate
from mscale_jax.config import ModelConfig
from mscale_jax.errors import ConfigError
from mscale_jax.model import abstract_model

MODELS = {
    # Sequential block, full attention, learned positions, layers scanned.
    "sequential-full-learned": ModelConfig(vocab_size=61, num_layers=2, hidden=32, num_heads=4,
                                           mlp_dim=64, seq_len=24, block="sequential"),
    # Parallel block, window 4 (prompt + generation run far past it), rotary, unscanned, SwiGLU.
    "parallel-window-rotary": ModelConfig(vocab_size=61, num_layers=2, hidden=32, num_heads=4,
                                          mlp_dim=64, seq_len=24, block="parallel",
                                          attention_window=4, positions="rotary",
                                          mlp_activation="swiglu", scan_layers=False),
}
PROMPT = np.array([5, 17, 3, 42, 8, 8])
NEW = 12


def random_params(config: ModelConfig, seed: int):
  """Random parameters large enough that the logits are far from uniform (no argmax ties)."""
  _, shapes, _ = abstract_model(config)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(x.dtype), shapes)


def full_forward(config: ModelConfig, params, tokens) -> np.ndarray:
  """float32 [len, vocab] logits of one sequence, without any cache."""
  model = generate.build_model(config, params)
  with jax.set_mesh(generate.one_device_mesh()):
    return np.asarray(model(jax.numpy.asarray(tokens[None], jax.numpy.int32))[0])


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
  config = MODELS[request.param]
  return config, random_params(config, seed=3)


def test_greedy_is_argmax_of_the_full_forward_step_by_step(model):
  config, params = model
  out = generate.generate(config, params, PROMPT, max_new_tokens=NEW, temperature=0.0)
  assert out.tokens.shape == (PROMPT.size + NEW,) and out.logits.shape == (NEW, 61)
  np.testing.assert_array_equal(out.tokens[:PROMPT.size], PROMPT)
  reference = full_forward(config, params, out.tokens[:-1])[PROMPT.size - 1:]
  np.testing.assert_allclose(out.logits, reference, atol=2e-4, rtol=2e-4)
  np.testing.assert_array_equal(out.tokens[PROMPT.size:], reference.argmax(-1))
  assert np.abs(np.diff(out.logits, axis=0)).max() > 0.1      # the context changes the logits
  again = generate.generate(config, params, PROMPT, max_new_tokens=NEW, temperature=0.0, seed=9)
  np.testing.assert_array_equal(again.tokens, out.tokens)


def test_sampling_is_seeded_and_stays_in_the_top_k():
  config = MODELS["parallel-window-rotary"]
  params = random_params(config, seed=4)
  draw = lambda seed: generate.generate(config, params, PROMPT, max_new_tokens=NEW,
                                        temperature=2.0, top_k=3, seed=seed)
  a, b, c = draw(0), draw(0), draw(1)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)
  for out in (a, c):
    top3 = np.argsort(out.logits, axis=-1)[:, -3:]
    assert all(t in row for t, row in zip(out.tokens[PROMPT.size:], top3))


def test_stop_token_ends_generation(model):
  config, params = model
  greedy = generate.generate(config, params, PROMPT, max_new_tokens=NEW, temperature=0.0)
  stop = int(greedy.tokens[PROMPT.size + 2])
  first = PROMPT.size + list(greedy.tokens[PROMPT.size:]).index(stop)
  out = generate.generate(config, params, PROMPT, max_new_tokens=NEW, stop_token=stop)
  np.testing.assert_array_equal(out.tokens, greedy.tokens[:first + 1])


@pytest.mark.parametrize("prompt,kwargs,field", [
    ([], {}, "prompt"),
    ([3, 61], {}, "prompt='token 61'"),
    ([-1], {}, "prompt='token -1'"),
    ([3], {"max_new_tokens": 0}, "max_new_tokens=0"),
    ([3], {"temperature": -1.0}, "temperature=-1.0"),
    ([3], {"top_k": 62}, "top_k=62"),
    ([3] * 20, {"max_new_tokens": 6}, "max_new_tokens=6"),    # 20 + 6 - 1 > seq_len 24
])
def test_bad_requests_are_config_errors(prompt, kwargs, field):
  config = MODELS["sequential-full-learned"]
  kwargs = {"max_new_tokens": 4, **kwargs}
  with pytest.raises(ConfigError, match=field.replace("[", r"\[")):
    generate.check_request(config, np.asarray(prompt, np.int64), kwargs["max_new_tokens"],
                           kwargs.get("temperature", 0.0), kwargs.get("top_k"))
