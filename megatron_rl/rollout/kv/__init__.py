"""The rollout's KV cache, by concept:

- kind.py: the run's KV kind (`slots` | `paged`), decided once at config load: its cache class,
  its byte rule (budget.py) and its admission, and its unit for the planner;
- cache.py: what both caches share (the K and V tensors, the sequences); slots.py and paged.py
  their own bookkeeping (pages.py: the paged cache's refcounted page pool);
- batch.py: what one forward covers, made by the cache and read by the attention (attention.py)
  and the MoE route recorder (route_rows.py).
"""
