"""The special token ids, defined once for the data and the model.

The shared SentencePiece vocabulary (`pipelines.tokenizer`) is trained with these ids fixed;
padding (0) is what the batches (`pipelines.batching`), the model's masks, the loss and the
searches all skip, BOS (2) starts every decoder input and EOS (3) ends every sentence.
"""

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
