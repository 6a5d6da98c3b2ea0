"""The per-metric denoiser: a small LSTM-VAE (Flax NNX) over fixed windows of one metric.

Minder (NSDI'25, §4) trains one LSTM-VAE per monitoring metric on normal data. The encoder reads
a machine's window of samples and gives the mean and log-variance of a small latent; the decoder
rebuilds the window from a latent sample. Trained on healthy windows only, it keeps the shape a
healthy machine's metric has and drops the noise: the latent mean is the machine's denoised
embedding (similarity.py compares them across machines), and the reconstruction error says how
far a window is from anything healthy.

Shapes: windows are [batch, window] floats (one metric, already normalised by windows.py);
embeddings [batch, latent]. Everything runs under `jax.jit` on the split parameters, so one
compiled program serves every metric of the same window length.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class VAEConfig:
  """Sizes and training of one metric's LSTM-VAE (small: the paper's models are per metric and
  cheap enough to run on thousands of machines every few seconds)."""
  hidden: int = 16          # LSTM width of encoder and decoder
  latent: int = 4           # embedding size
  beta: float = 0.05        # weight of the KL term (small: keep the latent informative)
  steps: int = 300          # Adam steps on healthy windows
  batch: int = 256
  learning_rate: float = 3e-3
  seed: int = 0


class LSTMVAE(nnx.Module):
  """Encoder LSTM -> (mean, log-variance) of the latent; decoder LSTM fed the latent at every
  step -> one value per step."""

  def __init__(self, window: int, config: VAEConfig, *, rngs: nnx.Rngs):
    self.window, self.hidden = window, config.hidden
    h, z = config.hidden, config.latent
    self.encoder = nnx.RNN(nnx.OptimizedLSTMCell(1, h, rngs=rngs), return_carry=True)
    self.to_mean = nnx.Linear(h, z, rngs=rngs)
    self.to_logvar = nnx.Linear(h, z, rngs=rngs)
    self.decoder = nnx.RNN(nnx.OptimizedLSTMCell(z, h, rngs=rngs))
    self.to_value = nnx.Linear(h, 1, rngs=rngs)

  def encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, W] -> latent mean and log-variance, each [B, latent]."""
    (_, hidden), _ = self.encoder(x[..., None], initial_carry=self._zeros(x.shape[0]))
    return self.to_mean(hidden), self.to_logvar(hidden)

  def decode(self, z: jax.Array) -> jax.Array:
    """z [B, latent] -> reconstructed window [B, W]."""
    steps = jnp.broadcast_to(z[:, None, :], (z.shape[0], self.window, z.shape[-1]))
    return self.to_value(self.decoder(steps, initial_carry=self._zeros(z.shape[0])))[..., 0]

  def _zeros(self, batch: int) -> tuple[jax.Array, jax.Array]:
    zeros = jnp.zeros((batch, self.hidden), jnp.float32)
    return zeros, zeros                   # (cell, hidden) state of an LSTM at the start


def _loss(graphdef, params, rest, x, key, beta):
  model = nnx.merge(graphdef, params, rest)
  mean, logvar = model.encode(x)
  z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
  recon = jnp.mean(jnp.square(model.decode(z) - x))
  kl = -0.5 * jnp.mean(jnp.sum(1 + logvar - mean ** 2 - jnp.exp(logvar), axis=-1))
  return recon + beta * kl


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _train_step(graphdef, tx, beta, params, rest, opt_state, x, key):
  loss, grads = jax.value_and_grad(_loss, argnums=1)(graphdef, params, rest, x, key, beta)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


@dataclasses.dataclass
class TrainedVAE:
  """A trained model as (graph, parameters, other state), with the jitted functions the
  detector calls."""
  graphdef: object
  params: object
  rest: object
  window: int
  losses: list

  def embed(self, windows: np.ndarray) -> np.ndarray:
    """[B, W] normalised windows -> [B, latent] latent means (the denoised embedding)."""
    return np.asarray(_embed(self.graphdef, self.params, self.rest,
                             jnp.asarray(windows, jnp.float32)))

  def reconstruct(self, windows: np.ndarray) -> np.ndarray:
    """[B, W] -> [B, W]: the window rebuilt from its latent mean (the denoised series)."""
    return np.asarray(_reconstruct(self.graphdef, self.params, self.rest,
                                   jnp.asarray(windows, jnp.float32)))

  def reconstruction_error(self, windows: np.ndarray) -> np.ndarray:
    """[B, W] -> [B]: mean squared difference between each window and its reconstruction."""
    return np.mean(np.square(self.reconstruct(windows) - np.asarray(windows)), axis=-1)


@functools.partial(jax.jit, static_argnums=0)
def _embed(graphdef, params, rest, x):
  return nnx.merge(graphdef, params, rest).encode(x)[0]


@functools.partial(jax.jit, static_argnums=0)
def _reconstruct(graphdef, params, rest, x):
  model = nnx.merge(graphdef, params, rest)
  return model.decode(model.encode(x)[0])


@functools.lru_cache(maxsize=None)
def _adam(learning_rate: float) -> optax.GradientTransformation:
  return optax.adam(learning_rate)   # one object per rate: the jitted step compiles once


def train_vae(windows: np.ndarray, config: VAEConfig = VAEConfig()) -> TrainedVAE:
  """Fits an LSTM-VAE to healthy `windows` [N, W] (normalised), `config.steps` Adam steps on
  random minibatches; returns the trained model with its loss curve."""
  windows = np.asarray(windows, np.float32)
  if windows.ndim != 2 or len(windows) == 0:
    raise ValueError(f"train_vae needs [N, W] windows, got shape {windows.shape}")
  model = LSTMVAE(windows.shape[1], config, rngs=nnx.Rngs(config.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = _adam(config.learning_rate)
  opt_state = tx.init(params)
  rng = np.random.default_rng(config.seed)
  key = jax.random.key(config.seed)
  losses = []
  for _ in range(config.steps):
    batch = windows[rng.integers(0, len(windows), min(config.batch, len(windows)))]
    key, sub = jax.random.split(key)
    params, opt_state, loss = _train_step(graphdef, tx, config.beta, params, rest, opt_state,
                                          jnp.asarray(batch), sub)
    losses.append(loss)
  return TrainedVAE(graphdef, params, rest, windows.shape[1], [float(l) for l in losses])
