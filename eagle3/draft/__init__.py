"""The draft: what an EAGLE-3 draft is and how it is scored.

- `model`: the draft module (fc over the target's aux states, one decoder layer, norm, lm_head;
  HF/SGLang weight names) and its TTT step.
- `masks`: causal and TTT attention masks.
- `losses`: the teacher distribution restricted to the draft vocabulary and the chunked soft
  cross-entropy.
- `vocab`: the draft vocabulary (`d2t`, `t2d`) counted from the training answers.

Imports nothing of the other wings.
"""
