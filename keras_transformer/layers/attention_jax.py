"""3.2.1 Scaled dot-product attention under Keras' JAX backend, by sequence lengths: cuDNN's
fused (flash) attention on NVIDIA GPUs.

The paper's two masks have structure that a boolean tensor hides: the encoder's and the
cross-attention's mask only the padding at the end of each key sequence (a length per row), and
the decoder's self-attention is causal. cuDNN's flash kernel takes exactly these (sequence
lengths and a causal flag) and then never reads a mask or builds the (target, source) scores in
memory; given a boolean mask instead, `jax.nn.dot_product_attention` turns it into an additive
bias of that full size, which is what `keras.ops.dot_product_attention(flash_attention=True)`
does with a mask (issue 36's prototype: 3% faster). Elsewhere (a CPU, or float32, which the
kernel does not take) the same call runs JAX's XLA reference of the same function, as Keras'
own flash fallback does, so the results match the explicit masks (tested on CPU: in float32
to round-off; in bfloat16 both paths are as far from float32, 0.5% of the largest logit).

Layout: JAX's (batch, length, heads, d_k), which the projections give without a transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The dtypes cuDNN's fused attention takes.
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def attention_implementation(dtype, head_size: int) -> str:
    """`jax.nn.dot_product_attention`'s implementation on the default device: "cudnn" (flash)
    where JAX's cuDNN path takes it (an NVIDIA GPU of compute capability 8.0 or later, 16-bit
    inputs, a head size that is a multiple of 8 and at most 128, or 256 from 9.0 on), else
    "xla", the reference (the same function, computed with masks)."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)  # CUDA devices alone have it
    if (device.platform != "gpu" or not capability or jnp.dtype(dtype) not in _CUDNN_DTYPES
            or head_size % 8):
        return "xla"
    major = float(capability)
    largest_head = 256 if major >= 9.0 else 128
    return "cudnn" if major >= 8.0 and head_size <= largest_head else "xla"


def key_lengths(key_mask):
    """Lengths of right-padded key sequences from their mask.

    Args:
        key_mask: bool (batch, 1, source_length), True on real keys, which come first in each
            row (the padding is at the end, as the project's batches make it; a mask with
            gaps would be read as its count of True).

    Returns:
        int32 (batch,), at least 1: a row of padding alone attends to its first position
        (its output is padding's, which no loss or decoding reads) rather than dividing by 0.
    """
    lengths = jnp.sum(key_mask[:, 0, :].astype(jnp.int32), axis=-1)
    return jnp.maximum(lengths, 1)


def attend_by_lengths(query, key, value, key_mask=None, causal: bool = False):
    """softmax(Q K^T / sqrt(d_k)) V with a key-padding mask given as lengths, or causal.

    Args:
        query: (batch, target_length, heads, d_k).
        key, value: (batch, source_length, heads, d_k).
        key_mask: optional bool (batch or 1, 1, source_length), True on real keys,
            right-padded (see `key_lengths`); None: every key is real.
        causal: query position i attends to key positions <= i (the decoder's
            self-attention; target_length == source_length).

    Returns:
        (batch, target_length, heads, d_k), in the query's dtype.
    """
    lengths = None
    if key_mask is not None:  # one mask for the whole batch: the same lengths for each row
        lengths = jnp.broadcast_to(key_lengths(key_mask), query.shape[:1])
    return jax.nn.dot_product_attention(
        query, key, value, key_value_seq_lengths=lengths, is_causal=causal,
        implementation=attention_implementation(query.dtype, query.shape[-1]))
