"""The special token ids, shared by the tokenizer, the model, the loss and decoding.

    PAD_ID = 0   padding; never attended to, loss weight 0
    EOS_ID = 1   appended to every source and target sequence; decoding stops on it
    UNK_ID = 2   SentencePiece's unknown piece
    BOS_ID = 3   the decoder's start token (the model shifts targets right with it)

The tokenizer is trained with exactly these ids, and refuses a model file that has others.
"""

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
BOS_ID = 3
