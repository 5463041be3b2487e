"""Hardware descriptions for replaying a trace: how fast a GPU computes, and how fast its links move bytes.

A `Hardware` is a few numbers per GPU (plain data, JSON in and out), enough for the two models
`parlab.cluster.replay` times a trace with:

* compute, roofline style (Williams, Waterman, Patterson, "Roofline", CACM 2009): a span that did F FLOPs in
  matrix products, moved M bytes in memory-bound ops, computed S special-function results and launched K kernels
  takes

      (F - F_b) / (peak_flops x efficiency)  +  F_b / bmm_flops
          +  M_cache / (cache_bw x mem_efficiency)  +  (M - M_cache) / (mem_bw x mem_efficiency)
          +  S / special_rate  +  (K - K_p) x kernel_overhead  +  K_p x plain_kernel_overhead

  `efficiency` is kernel-level: the fraction of the datasheet's dense peak that large matrix products (GEMMs)
  sustain, measured per kernel, not per training step (the replay simulates bubbles and communication itself).
  `mfu` is the end-to-end model-FLOPs utilisation of a whole training step (bubbles, communication and every
  other overhead inside it), for models that do not simulate those, e.g. `parlab.cluster.planner.estimate`
  (`end_to_end_mfu`; None: the same as `efficiency`, which is what a description written before the two were
  split meant by its one `efficiency`).

  On a CPU described by `parlab calibrate`, K x kernel_overhead and the bandwidths are fitted to whole training
  steps (`parlab.cluster.calibrate.step`): kernel_overhead is the cost of one aten op inside a step (autograd's and the
  optimizer's bookkeeping included), and the bandwidths carry a step's per-byte costs (fresh outputs' page
  faults), i.e. with the products' rates F fixed, t_step = F terms + K x c + beta x T_mem(M), mem_bw / beta.
  The formula is unchanged, so a description written before loads and means what it meant.

  K_p of the K kernels ran outside autograd (`Event.plain_kernels`: grad mode off and not in a backward node, i.e.
  the optimizer step, no-grad bookkeeping and the adds that accumulate gradients into .grad). On a CPU an op that
  autograd records or replays pays the engine's bookkeeping on top (graph nodes, saved tensors): a forward or
  backward op of a small GPT cost 14 us against 3 us per AdamW op in one calibration (benchmarks/README.md, round
  7), and a single per-op cost fitted to whole steps then overcharges a step whose optimizer runs few ops
  (ZeRO-3's flat shards: 6 tensors instead of 68) and undercharges its forward and backward.
  `plain_kernel_overhead` (optional; None: kernel_overhead) is the cost of such an op; `parlab calibrate` fits
  both from steps timed in two parts (`parlab.cluster.calibrate.step`).

  F_b are the FLOPs of batched products (bmm, baddbmm, attention kernels; `Event.batched_flops`), which a CPU
  runs at a rate of its own, `bmm_flops` (optional: None on the GPU presets, where they go at the product rate).

  Special functions (optional): S results of exp, log, erf, ... (`Event.special`, the ops of
  `parlab.trace.meter.SPECIAL_OPS`: softmax, logsumexp, GeLU) add S / special_rate on top of their bytes. A GPU
  computes them on its SFUs, 16 results per clock per SM (CUDA C++ Programming Guide, throughput of native
  arithmetic instructions, compute capability 8.0 and 9.0), about 1/250 of its product rate; a CPU in software,
  often slower than memory moves their operands (`parlab calibrate` measures it). None: no cost beyond the bytes.

  Two-level memory (optional, a CPU's caches; None on the GPU presets): M_cache are the bytes of the ops whose
  working set (the bytes an op reads and writes, as `parlab.trace.meter` counts them) fits in `cache_bytes`;
  they move at `cache_bw`, every other byte at `mem_bw`. The meter records each span's bytes per power-of-two
  size class of working set (`Event.mem_hist`: (k, bytes) for working sets in [2^k, 2^(k+1))); a class counts
  as cached when 2^(k+1) <= cache_bytes. Without `cache_bw` (or without a histogram) every byte moves at mem_bw;
* communication, alpha-beta (Hockney 1994; the ring costs of Patarasuk & Yuan 2009, as nccl-tests'
  PERFORMANCE.md counts them): a collective over N ranks takes ``base_latency + steps x hop_latency +
  factor x X / bandwidth`` on the slowest link its group crosses (NVLink inside a node, InfiniBand across
  nodes); `collective_time` has the factors and steps of each op, ring and (for all-reduce across nodes) tree.
  Inside a node a transfer sustains ``intra_bw x intra_efficiency``: the presets take NCCL's own planning figure
  for an NVLink link (20 of its 25 GB/s on A100), since nccl-tests never reach the datasheet's rate.
  Across nodes a group with k ranks on each node uses the network cards of all k GPUs at once (NCCL gives each
  ring or tree channel its own card), so a ring over whole nodes (FSDP, DP over nodes) gets k x inter_bw, up to
  NVLink's rate, while one rank per node (DP beside TP 8) gets one card; `inter_bandwidth`, `nics_per_node`.
* matrix products by shape (`gemm_time`, with `sms`): a GEMM runs in waves of output tiles, one tile per SM at
  a time, so a product whose tiles leave the last wave part-empty costs more than its FLOPs say (module
  constant GEMM_TILE; NVIDIA's "Matrix Multiplication Background" guide, section 3).
* inside a step (`comm_delay`; a CPU's description only): every transfer ends `comm_delay` seconds later than
  the link model says, without keeping a rank busy: a rank that blocks in the call, or waits for it, waits that
  much longer; compute issued meanwhile hides it; the group's next collective starts after it (gloo and NCCL run
  a group's calls in order). On a CPU whose cores each run a rank, a call made in the
  middle of a training step hands its work to the backend's threads, which must first get a core (and, on a
  virtual machine whose idle cores halt, wake one up): in FSDP steps here a 0.8 MB all-gather took 2.4-4.3 ms
  where the same call alone took 0.5-0.9 ms (benchmarks/README.md). `parlab calibrate` fits it to distributed
  training steps (`parlab.cluster.calibrate.programs`); 0 on the GPU presets (the link model is the whole cost).
* streams (`comm_streams`): how many collectives of one group a rank runs at once. NCCL runs a group's calls in
  order on one stream (1, the presets); torch's gloo backend hands them to a pool of worker threads, two per
  process group by default (`ProcessGroupGloo` options, ``threads``), so two calls can be in flight and a stalled
  one does not hold up the next. `parlab calibrate` reads the pool's size from torch.
* the rank's share (`comm_cpu`; with comm_overlap False): seconds of its rank's core an asynchronous call
  (collective or message) takes besides its transfer: gloo's threads wake up and run on the core the rank
  computes on. Here a GPT's
  backward with DDP's bucket all-reduces in flight took 0.6-1.2 ms more per bucket than under `no_sync` (7 to 24
  buckets of 0.05-0.25 MiB; benchmarks/README.md); `parlab calibrate` fits it with `comm_delay`.
* overlap (`comm_overlap`): on GPUs a collective or message issued asynchronously runs beside compute (NCCL's
  kernels, copy engines; True on the presets). On a CPU whose cores each run a rank, gloo moves the bytes with
  the ranks' own cores, so an asynchronous call does not overlap the rank's compute: with comm_overlap False the
  replay charges its time to the rank when it is issued. `parlab calibrate` measures which holds (a message in
  flight while the rank computes: is the compute slowed by the message's time?).

Presets (`PRESETS`, `hardware_preset(name)`): ``dgx-a100`` and ``dgx-h100``; each number is cited where it is set.
`parlab.cluster.calibrate` measures this machine (or a GPU node under torchrun) and writes its own description.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace

from parlab.cluster.collective_time import collective_seconds
from parlab.cluster.hardware_checks import check
from parlab.trace.wire import RING
from parlab.i18n import _

__all__ = ["Hardware", "PRESETS", "hardware_preset", "preset", "load", "COLLECTIVE_FACTORS", "GEMM_TILE"]

# NCCL's own latency model (src/graph/tuning.cc, NCCL 2.x, Ring algorithm with the Simple protocol that large
# messages use): a base latency per collective of 8.4 us and a per-step hardware latency of 5.7 us over NVLink /
# PCI and 6.6 us over the network. We use them for both presets: NVIDIA publishes no per-generation figure.
NCCL_BASE_LATENCY = 8.4e-6
NCCL_NVLINK_HOP = 5.7e-6
NCCL_NET_HOP = 6.6e-6


@dataclass(frozen=True)
class Hardware:
    """One GPU (or CPU rank) and its links. Rates are per GPU: FLOP/s, bytes/s per direction; times in s."""

    name: str
    peak_flops: float               # dense 16-bit matrix FLOP/s
    mem_bw: float                   # memory bandwidth, bytes/s
    intra_bw: float                 # bytes/s per GPU and direction inside a node (NVLink)
    inter_bw: float                 # bytes/s per direction of one network card (NIC) between nodes
    gpus_per_node: int = 8
    efficiency: float = 0.8         # kernel level: fraction of peak_flops that large matrix products sustain
    mem_efficiency: float = 0.8     # fraction of mem_bw that memory-bound kernels sustain
    kernel_overhead: float = 0.0    # seconds per kernel (launch and per-op framework cost)
    base_latency: float = NCCL_BASE_LATENCY   # seconds per collective call
    intra_latency: float = NCCL_NVLINK_HOP    # seconds per algorithm step inside a node
    inter_latency: float = NCCL_NET_HOP       # seconds per algorithm step across nodes
    source: str = ""                # where the numbers come from
    p2p_bw: float | None = None     # point-to-point messages, when they differ from the link (None: the link's)
    p2p_latency: float | None = None
    mfu: float | None = None        # end-to-end MFU of a training step (None: = efficiency; module docstring)
    cache_bw: float | None = None   # bytes/s of ops whose working set fits in cache_bytes (None: one level)
    cache_bytes: float = 0.0        # working-set size up to which an op runs at cache_bw
    bmm_flops: float | None = None  # FLOP/s of batched products (bmm, attention); None: peak_flops x efficiency
    comm_overlap: bool = True       # asynchronous communication overlaps compute (False: it takes the rank's core)
    special_rate: float | None = None  # special-function results per second (exp, log, erf; None: no extra cost)
    comm_delay: float = 0.0         # seconds a transfer inside a training step ends later than the link model says
    comm_streams: int = 1           # collectives of one group a rank runs at once (NCCL: 1 stream; gloo: its threads)
    comm_cpu: float = 0.0           # seconds of its rank's core an asynchronous call takes (comm_overlap False)
    plain_kernel_overhead: float | None = None  # seconds per kernel run outside autograd (None: kernel_overhead)
    p2p_delay: float | None = None  # comm_delay of a message (send / recv; None: comm_delay), parlab.cluster.calibrate.programs
    p2p_cpu: float | None = None    # comm_cpu of an asynchronous message (None: comm_cpu)
    # dense tensor-core FLOP/s per number format ("bf16", "fp8", ...; `at`); a dict, so left out of the hash
    precision_flops: dict | None = field(default=None, hash=False)
    sms: int | None = None          # streaming multiprocessors: GEMMs are timed by waves of tiles (`gemm_time`)
    intra_efficiency: float = 1.0   # fraction of intra_bw a transfer inside a node sustains (NCCL's own figure)
    nics_per_node: int | None = None  # network cards (rails) per node; None: one per GPU (`inter_bandwidth`)
    # kernel-level efficiency per number format where it was measured apart (`at`; others keep `efficiency`)
    precision_efficiency: dict | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        check(self)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Hardware":
        if not isinstance(d, dict):
            raise ValueError(f"a hardware description is a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown hardware field(s) {unknown}; known fields: {', '.join(sorted(known))}")
        missing = [k for k in ("name", "peak_flops", "mem_bw", "intra_bw", "inter_bw") if k not in d]
        if missing:
            raise ValueError(f"hardware description lacks {', '.join(missing)} (see parlab.cluster.hardware.Hardware)")
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def with_(self, **changes) -> "Hardware":
        """A copy with some fields changed, e.g. ``hardware_preset("dgx-h100").with_(efficiency=0.7)``."""
        return replace(self, **changes)

    def at(self, precision: str) -> "Hardware":
        """The same machine computing its products in `precision` ("bf16", "fp8", "tf32", ...): `peak_flops` is
        that format's dense tensor-core rate, and `efficiency` the format's own measured fraction of it where
        `precision_efficiency` gives one (the H100's fp8 GEMMs sustain less of their peak than bf16's). A format
        the GPU has no tensor cores for is refused, naming those it has (the A100 has no FP8)."""
        rates = self.precision_flops or {}
        if precision not in rates:
            known = ", ".join(rates) or _("none given (set precision_flops)")
            raise ValueError(_("{hardware} has no {precision!r} rate; its number formats: {known}").format(
                hardware=self.name, precision=precision, known=known))
        efficiency = (self.precision_efficiency or {}).get(precision, self.efficiency)
        return replace(self, name=f"{self.name} ({precision})", peak_flops=rates[precision], efficiency=efficiency,
                       bmm_flops=None if self.bmm_flops is None else
                       self.bmm_flops * rates[precision] * efficiency / (self.peak_flops * self.efficiency))

    # ------------------------------------------------------------------ models
    @property
    def end_to_end_mfu(self) -> float:
        """The fraction of peak a whole training step sustains, for models that simulate no bubble or
        communication (`mfu`, or `efficiency` when no separate MFU is given)."""
        return self.mfu if self.mfu is not None else self.efficiency

    def cached_bytes(self, mem_hist=()) -> float:
        """Bytes of a span's memory-bound ops that run at `cache_bw`: those of the size classes (k, bytes) of
        `mem_hist` whose working sets fit in `cache_bytes` (2^(k+1) <= cache_bytes); 0 without a cache level."""
        if self.cache_bw is None or not self.cache_bytes:
            return 0.0
        return float(sum(b for k, b in mem_hist if 2.0 ** (k + 1) <= self.cache_bytes))

    def compute_time(self, flops: float = 0.0, nbytes: float = 0.0, kernels: int = 0, mem_hist=(),
                     batched_flops: float = 0.0, special: float = 0.0, plain_kernels: int = 0) -> float:
        """Seconds of a compute span: matrix FLOPs at the sustained peak (the `batched_flops` among them at
        `bmm_flops` when given), memory-bound bytes at the sustained bandwidth of their level (cache or memory,
        by `mem_hist`: (k, bytes) per working-set size class 2^k), `special` function results at `special_rate`
        (when given), plus a fixed cost per kernel, `plain_kernels` of them (run outside autograd) at
        `plain_kernel_overhead` when given (see the module docstring)."""
        cached = min(self.cached_bytes(mem_hist), float(nbytes))
        batched = min(float(batched_flops), float(flops)) if self.bmm_flops is not None else 0.0
        t = ((flops - batched) / (self.peak_flops * self.efficiency)
             + (nbytes - cached) / (self.mem_bw * self.mem_efficiency))
        if batched:
            t += batched / self.bmm_flops
        if cached:
            t += cached / (self.cache_bw * self.mem_efficiency)
        if special and self.special_rate is not None:
            t += special / self.special_rate
        plain = min(plain_kernels, kernels) if self.plain_kernel_overhead is not None else 0
        return t + (kernels - plain) * self.kernel_overhead + plain * (self.plain_kernel_overhead or 0.0)

    def gemm_time(self, m: int, n: int, k: int, batch: int = 1) -> float:
        """Seconds of a matrix product (m x k) @ (k x n), `batch` of them, at the kernel-level `efficiency`.

        Without `sms`: its 2 m n k batch FLOPs at peak_flops x efficiency. With `sms`, by tiles and waves (NVIDIA,
        "Matrix Multiplication Background User's Guide", DU-09799-001, 2023, section 3, tile and wave
        quantization): the output is cut into GEMM_TILE tiles (256 x 128, the guide's example of a cuBLAS tile on
        A100), each SM computes one tile at a time, and every tile costs a full tile's work, so

            tiles = batch x ceil(m / 256) x ceil(n / 128),   waves = ceil(tiles / sms)
            time  = waves x sms x 2 x 256 x 128 x k / (peak_flops x efficiency)

        which equals the FLOP count at peak x efficiency when the tiles fill whole waves, and is up to twice as
        long when a last wave is nearly empty (e.g. 288 tiles on 108 SMs: 3 waves, 89% of their slots used)."""
        if min(m, n, k, batch) <= 0:
            return 0.0
        rate = self.peak_flops * self.efficiency
        if self.sms is None:
            return 2.0 * m * n * k * batch / rate
        tm, tn = GEMM_TILE
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / self.sms)
        return waves * self.sms * 2.0 * tm * tn * k / rate

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """(bandwidth in bytes/s, latency per step in s) of the slowest link a group uses, for one rank on each
        node; inside a node the bandwidth a transfer sustains, intra_bw x intra_efficiency."""
        if crosses_nodes:
            return self.inter_bandwidth("send", 1), self.inter_latency
        return self.intra_bw * self.intra_efficiency, self.intra_latency

    def inter_bandwidth(self, op: str, per_node: int) -> float:
        """Bytes/s a collective of `op` gets across nodes when its group holds `per_node` ranks on each node.

        The group's GPUs own per_node x nics_per_node / gpus_per_node of each node's network cards (every group
        of the same kind runs at once, sharing them). NCCL gives each channel (ring or tree) its own card:
        channels are assigned the node's NICs in turn (src/graph/search.cc, ``nets[(nChannels + i) % netCount]``)
        and a ring's bus bandwidth is channels x one card's (src/graph/tuning.cc, ``busBw = nChannels * bw``).
        A ring or tree crosses each node boundary once per channel, so its bytes cross at all those cards at once,
        up to what NVLink carries inside the node: min(cards x inter_bw, intra_bw x intra_efficiency). An
        all-to-all sends each rank's own bytes through its own share of the cards: no such sum."""
        nics = self.gpus_per_node if self.nics_per_node is None else self.nics_per_node
        cards = max(1, per_node) * nics / self.gpus_per_node
        if op in ("all_to_all", "send", "recv") or per_node <= 1:
            return self.inter_bw * nics / self.gpus_per_node
        return min(cards * self.inter_bw, self.intra_bw * self.intra_efficiency)

    def collective_time(self, op: str, nbytes: float, n: int, crosses_nodes: bool = False, nodes: int = 1,
                        algorithm: str = "auto") -> float:
        """Seconds of one call of `op` with payload `nbytes` (as `parlab.trace.Event.nbytes` counts it) over
        `n` ranks whose slowest link is inter-node when `crosses_nodes`, spread over `nodes` nodes: ring, tree,
        point-to-point and all-to-all as `parlab.cluster.collective_time.collective_seconds` says."""
        return collective_seconds(self, op, nbytes, n, crosses_nodes, nodes, algorithm)


#: output tile of one GEMM thread block, (rows, columns): the example of NVIDIA's "Matrix Multiplication Background
#: User's Guide" (section 3.2, wave quantization on an A100's 108 SMs), used by `Hardware.gemm_time`
GEMM_TILE = (256, 128)

#: (algorithm steps, bytes factor on the payload) of each op: the byte model of the trace (`parlab.trace.wire.RING`)
COLLECTIVE_FACTORS = RING


def _dgx_a100() -> Hardware:
    return Hardware(
        name="DGX A100",
        peak_flops=312e12,      # A100 SXM dense BF16 tensor core: 312 TFLOP/s (NVIDIA A100 datasheet)
        mem_bw=2.039e12,        # A100 80GB SXM HBM2e: 2,039 GB/s (NVIDIA A100 datasheet)
        intra_bw=300e9,         # NVLink 3: 600 GB/s bidirectional per GPU (12 links) = 300 GB/s each way
        inter_bw=25e9,          # DGX A100: 8 x 200 Gb/s HDR InfiniBand (ConnectX-6), one per GPU = 25 GB/s
        gpus_per_node=8,        # DGX A100 user guide: 8 GPUs per system
        # kernel level: "optimized GEMM can reach up to 80-90% of the theoretical maximum device throughput" on
        # A100 (Dao, FlashAttention-2, arXiv:2307.08691, section 1); we take the low end, 0.8
        efficiency=0.8,
        mfu=0.5,                # end to end: Megatron-LM on A100, 44-52% of peak (Narayanan et al. SC'21, table 1)
        # special functions (exp, log): 16 per clock per SM (CUDA C++ Programming Guide, arithmetic instruction
        # throughput, compute capability 8.0) x 108 SMs x 1.41 GHz boost (NVIDIA A100 whitepaper)
        special_rate=108 * 16 * 1.41e9,
        # dense tensor-core rates, A100 80GB SXM (NVIDIA A100 datasheet; its "with sparsity" figures are twice
        # these): TF32 156, BF16 = FP16 312, FP64 19.5 TFLOP/s; no FP8 tensor cores
        precision_flops={"fp64": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
        sms=108,                # A100: 108 streaming multiprocessors (NVIDIA A100 Tensor Core GPU architecture whitepaper)
        # NCCL plans an NVLink 3 link at 20 GB/s per direction (src/graph/topo.h, SM80_NVLINK_BW 20.0) of its 25:
        # 12 links x 20 = 240 of the 300 GB/s the datasheet's figure gives
        intra_efficiency=20.0 / 25.0,
        source="NVIDIA A100 datasheet and whitepaper, DGX A100 user guide; NCCL tuning.cc latencies, topo.h "
               "NVLink bandwidth")


def _dgx_h100() -> Hardware:
    return Hardware(
        name="DGX H100",
        peak_flops=989e12,      # H100 SXM dense BF16: 989 TFLOP/s (1,979 with sparsity; NVIDIA H100 datasheet)
        mem_bw=3.35e12,         # H100 SXM HBM3: 3.35 TB/s (NVIDIA H100 datasheet)
        intra_bw=450e9,         # NVLink 4: 900 GB/s bidirectional per GPU (18 links) = 450 GB/s each way
        inter_bw=50e9,          # DGX H100: 8 x 400 Gb/s NDR InfiniBand (ConnectX-7), one per GPU = 50 GB/s
        gpus_per_node=8,        # DGX H100 user guide: 8 GPUs per system
        # kernel level, measured: torch.matmul in BF16 on an H100 SXM sustains 794.5 of its 989 TFLOP/s (80.3%;
        # best shape 2048x2048x13312, torch 2.7.0+cu126; Bekman, "Machine Learning Engineering Open Book",
        # github.com/stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
        # comparison table", found by its mamf-finder.py); 0.80, the figure to the two places it is good for
        efficiency=0.8,
        mfu=0.5,                # end to end: the A100's figure (no published H100 Megatron table here)
        # special functions: "989 TFLOPS of FP16 matmul but only 3.9 TFLOPS of special functions" (Shah et al.,
        # FlashAttention-3, arXiv:2407.08608); 16 per clock per SM x 132 SMs x ~1.83 GHz gives the same
        special_rate=3.9e12,
        # dense tensor-core rates, H100 SXM (NVIDIA H100 datasheet, whose TF32, BF16, FP16 and FP8 figures are
        # with sparsity, twice these): FP64 67, TF32 494.5, BF16 = FP16 989, FP8 1,979 TFLOP/s
        precision_flops={"fp64": 67e12, "tf32": 494.5e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
        # FP8 (float8_e4m3fn) matmul on an H100 SXM, measured: 1,402.6 of 1,979 TFLOP/s (70.9%; best shape
        # 1024x9216x14336, torch 2.7.0+cu126; the same MAMF table); no other format measured apart here
        precision_efficiency={"fp8": 1402.6 / 1979},
        sms=132,                # H100 SXM: 132 streaming multiprocessors (NVIDIA H100 Tensor Core GPU architecture)
        # NCCL plans an NVLink 4 link at 20.6 GB/s per direction (src/graph/topo.h, SM90_NVLINK_BW 20.6) of its
        # 25: 18 links x 20.6 = 371 of the 450 GB/s the datasheet's figure gives
        intra_efficiency=20.6 / 25.0,
        source="NVIDIA H100 datasheet and architecture whitepaper, DGX H100 user guide; NCCL tuning.cc latencies, "
               "topo.h NVLink bandwidth; ml-engineering's MAMF table (measured BF16 and FP8 matmul rates)")


PRESETS: dict[str, Hardware] = {"dgx-a100": _dgx_a100(), "dgx-h100": _dgx_h100()}


def hardware_preset(name: str) -> Hardware:
    """A named hardware description: 'dgx-a100' or 'dgx-h100'."""
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(PRESETS)} "
                         f"(or load a JSON file written by `parlab calibrate` with parlab.cluster.hardware.load)")
    return PRESETS[name]


#: the old name of `hardware_preset`, kept for saved notebooks (``parlab.cluster.costs.preset`` is another function)
preset = hardware_preset


def load(path_or_name: str) -> Hardware:
    """A preset by name, or a JSON file written by `Hardware.save` / `parlab calibrate`."""
    if path_or_name in PRESETS:
        return PRESETS[path_or_name]
    try:
        with open(path_or_name) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no hardware preset or file named {path_or_name!r}; presets: {', '.join(PRESETS)}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path_or_name} is not valid JSON ({err}); write it with Hardware.save") from None
    return Hardware.from_dict(data)
