"""mscale_jax.sdp4bit.wire: collective bytes read from compiled programs."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from mscale_jax import mesh as mesh_lib
from mscale_jax.sdp4bit import wire


def _compiled(fn, *args):
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 4, "stage": 1, "tensor": 1})
  with jax.set_mesh(mesh):
    f = jax.shard_map(fn, in_specs=P(("data", "fsdp")), out_specs=P(("data", "fsdp")),
                      axis_names={"data", "fsdp"}, check_vma=False)
    return jax.jit(f).lower(*args).compile().as_text()


def test_sizes_groups_and_loop_trip_counts():
  """A psum over 'fsdp' of f32[1, 256] once, and an all-gather over 'data' of u8[1, 512]
  inside a 3-trip loop: the counts, operand sizes and ring bytes follow."""
  def fn(x):
    total = jax.lax.psum(x, "fsdp")
    codes = (x > 0).astype(jnp.uint8)
    codes = jnp.concatenate([codes, codes], axis=1)

    def body(i, acc):
      gathered = jax.lax.all_gather(codes + i.astype(jnp.uint8), "data")
      return acc + gathered.sum(0)[:, :256].astype(jnp.float32)
    return jax.lax.fori_loop(0, 3, body, total)

  x = jax.random.normal(jax.random.key(0), (8, 256))
  by_kind = wire.bytes_by_kind(_compiled(fn, x))
  assert by_kind["all-reduce"]["executions"] == 1
  assert by_kind["all-reduce"]["operand_bytes"] == 256 * 4
  assert by_kind["all-reduce"]["sent_bytes"] == pytest.approx(2 * 3 / 4 * 256 * 4)
  assert by_kind["all-gather"]["executions"] == 3
  assert by_kind["all-gather"]["operand_bytes"] == 3 * 512
  assert by_kind["all-gather"]["sent_bytes"] == 3 * 512 * (2 - 1)


def test_type_bytes_of_arrays_and_tuples():
  assert wire.type_bytes("f32[4,8]{1,0}") == 128
  assert wire.type_bytes("(u8[2,64]{1,0}, f32[2]{0})") == 128 + 8
  assert wire.type_bytes("bf16[]") == 2
