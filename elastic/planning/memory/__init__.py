"""KV and memory pricing: what a rank's memory holds, in bytes and KV positions.

    kv_unit.py        how a KV cache holds a request (`KVUnit`: tokens, slots or pages)
    kv.py             the batch's KV demand over the rollout and each rank's KV budget (`Demand`, `RankKV`)
    train_memory.py   one training rank's memory by part (weights, optimizer state, gradients, activations)
"""
