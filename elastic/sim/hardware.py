"""The machine a cost model prices (`costmodel.CostModel`): the model's shape on its nodes and the
hardware's rates and latencies, H100-80GB SXM nodes of 8 GPUs by default (the setup arXiv
2611.06984 measured), with their checks. Each constant says where it comes from; the ones marked
*assumption* have no public measurement we could find and are the first to recalibrate
(`step_fit.calibrate`, or a YAML file of field overrides: `flexfloor simulate --cost`).

Apart from the cost model because these are the inputs, which a YAML file, a calibration or a
scaling (`CostModel.scaled`) replaces field by field, while the cost model is the formulas that
price a step, an all-to-all, a prefill and a shrink from them.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from elastic.planning.shape import QWEN3_30B_A3B_H100, ModelShape

# DeepEP v1 low-latency kernels (docs/legacy.md of deepseek-ai/DeepEP, H800 + CX7 400 Gb/s, 128
# tokens per rank, hidden 7168, top-8, FP8 dispatch + BF16 combine): dispatch + combine latency per
# MoE layer at EP 16/32/64/128/256 = 118+195, 155+273, 173+314, 192+369, 194+360 microseconds.
_DEEPEP_LL_US = ((16, 313.0), (32, 428.0), (64, 487.0), (128, 561.0), (256, 554.0))
# Half of each figure is taken as fixed latency (assumption: DeepEP publishes no small-batch sweep);
# the other half is bandwidth-bound traffic, which scales with tokens x hidden.
_LATENCY_SHARE = 0.5


_MAY_BE_ZERO = ("step_overhead_s", "a2a_intra_per_peer_s", "restore_extra_s", "host_cores")


def _require(cond: bool, message: str) -> None:
    # elastic/ does not import megatron_rl: a ValueError here becomes a ConfigError naming the YAML
    # file when the CLI loads the model with megatron_rl.config.load_dataclass.
    if not cond:
        raise ValueError(f"cost model: {message}")


@dataclass(frozen=True)
class Hardware:
    name: str = ""  # "": the shape's name
    # ---- the model and its nodes: sizes, layers, heads, ranks per node (elastic/planning/shape.py) --
    shape: ModelShape = QWEN3_30B_A3B_H100
    # ---- hardware (H100 SXM5 80GB, nodes of 8) ----------------------------------------------------
    # 70% of the 3.35 TB/s HBM3 peak (NVIDIA H100 datasheet); 70% is an assumption for decode kernels.
    hbm_bytes_per_s: float = 0.70 * 3.35e12
    # 40% of the 989 TFLOP/s dense BF16 peak (datasheet); assumption for small-batch GEMMs.
    flops_per_s: float = 0.40 * 989e12
    # Scheduler, sampling and kernel launches per step (assumption; calibrate from a GPU run).
    step_overhead_s: float = 2.0e-3
    # All-to-all inside one NVLink node, per MoE layer, dispatch + combine. Latency: assumption
    # (about a quarter of DeepEP's RDMA EP8 figure of 191 us). Bandwidth: DeepEP normal kernels,
    # intranode EP8 on H800, 153 GB/s (H100's NVLink is faster, so this is conservative).
    a2a_intra_latency_s: float = 48e-6
    # Extra latency per peer beyond the first (pairwise exchanges, e.g. gloo over TCP on a CPU
    # host). NVLink kernels write to every peer at once, so 0 on H100 (assumption).
    a2a_intra_per_peer_s: float = 0.0
    a2a_intra_bytes_per_s: float = 153e9
    # Ranks sharing a CPU host (`host_cores` > 0): the in-node latency per MoE layer measured for each
    # EP size, [[ep_size, seconds], ...], interpolated between sizes; it replaces latency + per-peer,
    # since a group larger than the free cores time-shares them and does not grow by peers. Empty
    # (no host table) on accelerators; `calibrate` measures it.
    a2a_host_latency_s: tuple[tuple[float, float], ...] = ()
    # Across nodes (RDMA): latency per EP size from the DeepEP table above (log-interpolated),
    # bandwidth chosen so latency + reference traffic / bandwidth reproduces DeepEP's EP16 figure.
    a2a_inter_latency_s: tuple[tuple[float, float], ...] = tuple(
        (ep, _LATENCY_SHARE * us * 1e-6) for ep, us in _DEEPEP_LL_US)
    a2a_inter_bytes_per_s: float = (128 * 8 * 7168 * 3) / ((1 - _LATENCY_SHARE) * 313e-6)
    # Expert moves of a shrink/restore: NVLink point-to-point at about 2/3 of the 450 GB/s per
    # direction (assumption), and one 400 Gb/s NIC per GPU (50 GB/s) at 90% across nodes.
    transfer_intra_bytes_per_s: float = 300e9
    transfer_inter_bytes_per_s: float = 45e9
    # Routing-table swap + group switch + barrier per shrink/restore (assumption; the communicators
    # are created before the rollout, so this is no rendezvous).
    shrink_fixed_s: float = 0.05
    # What a restore costs beyond a shrink with the same moves: the runtime re-verifies every held
    # weight against its pre-rollout checksum and wakes the detached ranks. 0 here (assumption, not
    # measured on H100); `calibrate_transitions` measures it on the CPU engine.
    restore_extra_s: float = 0.0
    # 0: every rank has its own accelerator. N > 0: all ranks share one host's N cores (the CPU
    # engine), so a step's per-rank work runs max(1, busy ranks / N) times slower. May be
    # fractional: the cores left to the ranks by other load on the host (`calibrate` fits it).
    host_cores: float = 0

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.shape.name)
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and f.name not in _MAY_BE_ZERO:
                _require(v > 0, f"{f.name}: expected > 0, got {v}")
        for name in _MAY_BE_ZERO:
            _require(getattr(self, name) >= 0, f"{name}: expected >= 0, got {getattr(self, name)}")
        pts = [tuple(p) for p in self.a2a_inter_latency_s]
        _require(len(pts) >= 1 and all(len(p) == 2 and p[0] > 0 and p[1] >= 0 for p in pts),
                 "a2a_inter_latency_s must be a list of [ep_size, seconds] pairs")
        _require([p[0] for p in pts] == sorted({p[0] for p in pts}),
                 "a2a_inter_latency_s ep sizes must be strictly increasing")
        object.__setattr__(self, "a2a_inter_latency_s", tuple((int(e), float(s)) for e, s in pts))
        host = [tuple(p) for p in self.a2a_host_latency_s]
        _require(all(len(p) == 2 and p[0] > 1 and p[1] >= 0 for p in host),
                 "a2a_host_latency_s must be a list of [ep_size > 1, seconds] pairs")
        _require([p[0] for p in host] == sorted({p[0] for p in host}),
                 "a2a_host_latency_s ep sizes must be strictly increasing")
        object.__setattr__(self, "a2a_host_latency_s", tuple((int(e), float(s)) for e, s in host))

