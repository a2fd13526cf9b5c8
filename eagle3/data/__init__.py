"""The data the draft learns from, from prompts to hidden states.

- `prompts`: built-in and `.jsonl` prompts; `chat`: chat template, tokens and loss mask.
- `regeneration`: the target answers every prompt (local HF generate, SGLang /generate, an OpenAI
  endpoint); `server_pool`: the servers it asks, failover and `failed.jsonl`.
- `samples`: `samples.jsonl` and the train/validation split.
- `capture`: the target's aux hidden states at SGLang's layer ids; `dump`, `shards`, `disk`: the
  offline shards, their manifest and the free-space check.
- `state_codec`: the stored states' dtypes, the opt-in fp8 (e4m3 + block scales) encoding.
- `datasets`: what the trainer reads; `target`: the target loaded in transformers, or only its head.
- `tiny_target`: the embedded CPU target built from the Python stdlib.
- `generate`: the data stage's entry, `generate_dataset`.

May import the draft wing (the vocabulary); never training or serving.
"""
