"""Streamed hidden states (`data.hidden_states: stream`): the train split captured while training runs.

At the seed's scale (100K samples x 2K tokens of Kimi-K2.5: ~11.5 TB of bf16 states) the offline
shards do not fit a GPU host's disk. Here the capture side (`producer`, one process on the data
host with the target's engine) writes shards in exactly the order training consumes them
(`eagle3.training.schedule.DataPlan` slots, epoch by epoch, each epoch captured again), at most
`data.stream.disk_budget_gb` ahead; the training side (`dataset.StreamedDataset`, read by every
rank on the same host) reads them by slot and reports how far it got; consumed shards are
deleted. Both sides meet only through files in one folder (`layout`): no extra service.
"""
