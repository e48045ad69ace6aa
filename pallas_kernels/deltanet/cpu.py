"""The CPU gated delta rule (cpu_deltanet.cc), called with deltanet.delta_rule's arguments but the
whole recurrent-state cache in place of the gathered states; built and registered as an XLA FFI
custom call by pallas_kernels/cpu_library.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_library
from pallas_kernels.cpu_library import KernelUnavailable

TARGET = "jaxbatch_delta_rule"


def available() -> bool:
    """The kernel can run in this process: the library is registered (on the CPU platform)."""
    return cpu_library.registered()


def delta_rule_in_place(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                        beta: jax.Array, state: jax.Array, lay, *, layer: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
    """q, k [T, Hk, dk] f32 (L2-normed, q scaled; value head h reads key head h // (Hv / Hk)),
    v [T, Hv, dv], g (log decay), beta [T, Hv]; state the cache's recurrent states [L_linear,
    slots, Hv, dk, dv] f32; lay a deltanet.StepLayout; layer the layer's index among the
    DeltaNet layers -> (o [T, Hv, dv] f32 (zeros for padding tokens), state with each real
    sequence's slot `lay.write_slot` holding its state after its last new token).

    deltanet.delta_rule's result up to f32 summation order, the states read from
    `lay.read_slot` (zeros for `lay.fresh`) and written to `lay.write_slot` by the kernel in
    place: `state` is aliased to the second output (donate the cache through the step, or XLA
    copies it first). A sequence with no new tokens is not touched; a write slot outside the
    cache (NO_SLOT) is not written. Slots and token ranges that do not fit (a slot or layer
    outside the cache, two sequences writing one slot, overlapping tokens) fail the call with a
    ValueError naming them (cpu_deltanet.cc)."""
    if not cpu_library.registered():
        raise KernelUnavailable("cpu_library.register(cache_dir) first")
    f32, i32 = jnp.float32, jnp.int32
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(v.shape, f32),
                                     jax.ShapeDtypeStruct(state.shape, f32)),
                            input_output_aliases={5: 1}, vmap_method="sequential")
    o, new_state = call(q.astype(f32), k.astype(f32), v.astype(f32), g.astype(f32),
                        beta.astype(f32), state, jnp.asarray(layer, i32).reshape(1),
                        lay.start.astype(i32), lay.new.astype(i32), lay.read_slot.astype(i32),
                        lay.write_slot.astype(i32), lay.fresh.astype(i32))
    return o, new_state
