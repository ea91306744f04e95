"""Data pipelines for the Transformer: corpora, the shared subword tokenizer, token batches.

- :mod:`pipelines.corpora`: load and validate parallel corpora (local folders, tfds).
- :mod:`pipelines.multi30k_tfds`: the ``multi30k`` tensorflow-datasets builder.
- :mod:`pipelines.tokenizer`: sentencepiece vocabulary, applied in the TF graph.
- :mod:`pipelines.batching`: length-bucketed, token-budget ``tf.data`` batches.

Data flows one way: nothing here imports ``keras_transformer``.
"""
