"""6.1 decoding's settings: "beam search with a beam size of 4 and length penalty α = 0.6 ...
maximum output length during inference to input length + 50".

Without TensorFlow (plain numbers), so that what reads a run's or an export's decoding
settings (`run_directory.run_decoding`) imports on any Keras backend, as the JAX runs of GPU
machines without TensorFlow do.
"""

DEFAULT_BEAM_SIZE = 4
DEFAULT_ALPHA = 0.6
DEFAULT_EXTRA_LENGTH = 50
# Sources are cut to this many subword tokens (EOS included) before decoding.
DEFAULT_MAX_INPUT_TOKENS = 256
