"""Data pipelines for the Transformer: corpora, the shared subword tokenizer, token batches.

- :mod:`pipelines.textfiles`, :mod:`pipelines.tfds_corpora`, :mod:`pipelines.corpora`:
  stream and validate parallel corpora (local folders, tfds).
- :mod:`pipelines.multi30k_tfds`: the ``multi30k`` tensorflow-datasets builder.
- :mod:`pipelines.tokenizer`: sentencepiece vocabulary, applied in the TF graph.
- :mod:`pipelines.batching`: length-bucketed, token-budget ``tf.data`` batches.
- :mod:`pipelines.prepared`: a training split prepared once: tokenizer and token shards
  (their file format and checks: :mod:`pipelines.shard_files`).
- Numpy alone, for machines without TensorFlow (Keras' JAX backend):
  :mod:`pipelines.numpy_batches` yields a prepared folder's batches, the same as the
  ``tf.data`` pipeline's, from :mod:`pipelines.prepared_folder` (manifest, checks),
  :mod:`pipelines.batch_plan` (budget, buckets, orders, resume position) and
  :mod:`pipelines.philox` (TensorFlow's stateless shuffle).
- :mod:`pipelines.carving`: val/test splits carved out of a training split (seeded,
  deduplicated against train) and its noise dropped (:mod:`pipelines.pair_selection`).
- :mod:`pipelines.storage`: every file written whole or not at all (temporary name, fsync,
  rename) and ``StorageError`` for a full or failing disk; used by ``keras_transformer`` too.
- :mod:`pipelines.constants`: the special token ids.

Data flows one way: nothing here imports ``keras_transformer``.
"""

# Defaults of the preparation (pipelines.prepared), here so that command lines can show them
# without importing TensorFlow.
DEFAULT_TOKENIZER_SAMPLE = 500_000  # pairs: 1M sentences, what SentencePiece handles well
DEFAULT_SHARD_PAIRS = 100_000
DEFAULT_CARVE_PAIRS = 1000  # pairs carved for val and for test (pipelines.carving)
