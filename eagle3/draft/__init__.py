"""The draft: what an EAGLE-3 draft is and how it is scored.

- `model`: the draft module (fc over the target's aux states, one decoder layer, norm, lm_head;
  HF/SGLang weight names) and its TTT step.
- `fused_layer`: the layer's weights as the TTT unroll uses them (fused, cast once, gradients
  summed inside the GEMMs).
- `masks`: causal and TTT attention masks.
- `losses`: the teacher distribution restricted to the draft vocabulary and the chunked soft
  cross-entropy.
- `vocab`: the draft vocabulary (`d2t`, `t2d`) counted from the training answers.

Imports nothing of the other wings.
"""
