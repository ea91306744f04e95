"""TensorFlow's stateless shuffle with the Philox algorithm, in numpy alone.

``stateless_shuffle(n, seed)`` equals, element for element,
``tf.random.experimental.stateless_shuffle(tf.range(n), seed, alg="philox")``: what the
input pipeline (:mod:`pipelines.batching`) draws in its graph, reproduced where TensorFlow
is absent (:mod:`pipelines.numpy_batches`) or for eager arithmetic on the stream
(:class:`pipelines.batch_plan.StreamPosition`). tests/pipelines/test_numpy_batches.py
compares the two.

TensorFlow's steps (``random_ops_util._philox_scramble_seed``, the ``StatelessShuffle``
kernel, ``random::PhiloxRandom``):

1. the int64 seed pair, as uint64, is the counter of one Philox-4x32-10 block under the
   fixed key ``0x02461E293EC8F720``; its four uint32 outputs ``m`` give the key
   ``m[0] | m[1] << 32`` and the counter ``(0, m[2] | m[3] << 32)``;
2. Philox-4x32-10 (Salmon et al. 2011) from that key and 128-bit counter yields four
   uint32 per block, the counter incremented by one per block;
3. a forward Fisher-Yates shuffle takes the i-th uint32 ``u`` for position ``i`` and swaps
   it with ``i + u % (n - i)``, for ``i = 0 .. n - 2``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["philox_4x32_10", "stateless_shuffle"]

_SCRAMBLE_KEY = 0x02461E293EC8F720  # TensorFlow's key for turning a seed into key and counter
_MULTIPLIERS = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)  # the Weyl sequence that bumps the key each round
_LOW = np.uint64(0xFFFFFFFF)
_WORD = np.uint64(32)
_UINT64 = (1 << 64) - 1
# Beyond this TensorFlow draws 64-bit numbers per swap; a chunk never holds that many pairs.
_MAX_SHUFFLE = 2**31 - 1


def philox_4x32_10(key: int, counter: tuple[int, int], blocks: int) -> np.ndarray:
    """uint32 ``[4 * blocks]``: Philox-4x32-10 of the counters ``counter, counter + 1, ...``
    (128-bit, given as two uint64, low first) under the 64-bit ``key``, as TensorFlow's
    ``PhiloxRandom`` yields them."""
    steps = np.arange(blocks, dtype=np.uint64)
    low = np.uint64(counter[0] & _UINT64) + steps  # wraps modulo 2**64: carried below
    high = np.uint64(counter[1] & _UINT64) + (low < steps).astype(np.uint64)
    c0, c1, c2, c3 = low & _LOW, low >> _WORD, high & _LOW, high >> _WORD
    k0, k1 = key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF
    for _ in range(10):
        product0, product1 = _MULTIPLIERS[0] * c0, _MULTIPLIERS[1] * c2  # 32 x 32 -> 64 bits
        c0, c1, c2, c3 = ((product1 >> _WORD) ^ c1 ^ np.uint64(k0), product1 & _LOW,
                          (product0 >> _WORD) ^ c3 ^ np.uint64(k1), product0 & _LOW)
        k0, k1 = (k0 + _KEY_STEPS[0]) & 0xFFFFFFFF, (k1 + _KEY_STEPS[1]) & 0xFFFFFFFF
    return np.stack([c0, c1, c2, c3], axis=1).reshape(-1).astype(np.uint32)


def _key_counter(seed: Sequence[int]) -> tuple[int, tuple[int, int]]:
    """TensorFlow's key and counter for a Philox op from an int64 seed pair."""
    first, second = (int(s) & _UINT64 for s in seed)
    mix = [int(m) for m in philox_4x32_10(_SCRAMBLE_KEY, (first, second), 1)]
    return mix[0] | mix[1] << 32, (0, mix[2] | mix[3] << 32)


def stateless_shuffle(n: int, seed: Sequence[int]) -> np.ndarray:
    """int64 ``[n]``: ``tf.random.experimental.stateless_shuffle(tf.range(n), seed,
    alg="philox")`` (see the module docstring).

    Args:
      n: how many items; at most 2**31 - 1.
      seed: two ints, each an int64 (wrapped as TensorFlow's int64 arithmetic would).
    """
    if not 0 <= n <= _MAX_SHUFFLE:
        raise ValueError(f"stateless_shuffle takes 0 to {_MAX_SHUFFLE} items, got {n}")
    if len(seed) != 2:
        raise ValueError(f"seed must be two ints, got {seed!r}")
    order = list(range(n))
    if n < 2:
        return np.asarray(order, np.int64)
    key, counter = _key_counter(seed)
    draws = philox_4x32_10(key, counter, -(-(n - 1) // 4))[:n - 1].astype(np.int64)
    first = np.arange(n - 1, dtype=np.int64)
    swaps = (first + draws % (n - first)).tolist()
    for i, j in enumerate(swaps):  # sequential by nature; ~50 ns per item
        order[i], order[j] = order[j], order[i]
    return np.asarray(order, np.int64)
