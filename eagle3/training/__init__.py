"""Training the draft.

- `train`: the stage entry (`train_draft`) and each torchrun rank's entry.
- `trainer`: the loop; `ttt`: the TTT objective and its statistics; `schedule`: data order, LR
  schedule, batch padding; `distributed`: the torchrun process group; `checkpoints`: atomic
  checkpoints and resume; `curves`: the training curves PNG; `adamw`: AdamW's step as one compiled
  pass per parameter.
- `torchrun`: torchrun launches, one node or several (importable without torch).

May import the draft and data wings; never export or serving.
"""
