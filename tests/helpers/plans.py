"""The layout tests plan on: what a command builds once (`megatron_rl.parallel.dims.parallel_dims`)
and hands to `make_plan`, for a world only planned or simulated (no ranks run it)."""
from elastic.planning.dims import ParallelDims


def planned_dims(ranks: int, shape, ownership: str = "balanced") -> ParallelDims:
    """`ranks` ranks over the experts of `shape` (`ModelShape`), under `ownership`."""
    return ParallelDims(ranks, shape.num_experts, ownership, even=False)
