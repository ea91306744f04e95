"""Analytic FLOP counts of the Transformer, for model FLOP utilisation (MFU).

Counts multiply-adds of matrix products as 2 FLOPs; ignores softmax, LayerNorm, activations,
dropout and the optimizer update (all O(parameters) or O(tokens * d_model), under 2% here).

Per source token, per encoder layer:
    Q, K, V, O projections          4 * 2 * d^2
    scores Q K^T and weights x V    2 * 2 * S * d
    feed-forward                    2 * 2 * d * d_ff
Per target token, per decoder layer:
    self-attention                  4 * 2 * d^2 + 2 * 2 * T * d
    cross-attention Q, O            2 * 2 * d^2 + 2 * 2 * S * d
    feed-forward                    2 * 2 * d * d_ff
  plus, per source token, the cross-attention K, V projections: 2 * 2 * d^2
Per target token, the output projection: 2 * d * V.
A training step (forward + backward) costs 3x the forward pass: the backward pass computes
gradients with respect to both activations and weights, each as costly as the forward.
"""

from __future__ import annotations


def forward_flops(
    batch: int, source_length: int, target_length: int, num_layers: int, d_model: int,
    d_ff: int, vocab_size: int,
) -> float:
    """FLOPs of one forward pass over a padded batch (all positions counted)."""
    d, s, t = d_model, source_length, target_length
    encoder = s * (8 * d * d + 4 * s * d + 4 * d * d_ff)
    decoder = t * (8 * d * d + 4 * t * d + 4 * d * d + 4 * s * d + 4 * d * d_ff) + s * 4 * d * d
    logits = t * 2 * d * vocab_size
    return float(batch * (num_layers * (encoder + decoder) + logits))


def train_step_flops(*args, **kwargs) -> float:
    """FLOPs of one training step: 3 x `forward_flops` with the same arguments."""
    return 3.0 * forward_flops(*args, **kwargs)
