"""ServerArgs: everything `python -m dsv4 serve` is told; flag names follow SGLang's where one exists."""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field, fields

from dsv4.config.faults import FaultInjection
from dsv4.config.model import ConfigError, compile_disabled_by_env


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); without it torch's CPU bf16
    matmuls convert to fp32 first and run slower than fp32 itself."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def cpu_kernel_isa() -> str | None:
    """The vector instructions the CPU kernels (dsv4/kernels/cpu_library.py) are built for here:
    "avx512_bf16" (AVX-512 with bf16 pair products: a Zen 4, a Xeon since Cooper Lake), else "avx2"
    (with FMA: most x86 CPUs since 2013, a Zen 2 or 3 among them), else None (they do not run)."""
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        return "avx512_bf16"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles for bf16 (a Xeon since Sapphire Rapids), where oneDNN's fp32
    matmuls run as bf16 products (`fp32_precision = "bf16"`) several times faster than in fp32."""
    return "amx_bf16" in _cpu_flags()


def auto_dtype(device: str | None) -> str:
    """`--dtype auto`: the faster of bf16 and fp32 where the model will run."""
    import torch  # here, not at the top: ServerArgs is built before anything else needs torch

    on_cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    return "bfloat16" if on_cuda or cpu_has_fast_bf16() else "float32"


# -- choices -------------------------------------------------------------------------------------

DTYPES = ("bfloat16", "float32", "float64")  # float64 exists for oracle tests
DTYPE_CHOICES = ("auto", *DTYPES)  # auto: resolved in ServerArgs.__post_init__ (auto_dtype)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
INDEX_KEY_DTYPES = ("fp8", "bf16", "fp32")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEVICES = ("cpu", "cuda")
VERIFY_INDEXER_MODES = ("off", "count", "full", "fail")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
HICACHE_WRITE_POLICIES = ("write_through", "write_back")


@dataclass(frozen=True)
class ServerArgs:
    """Everything `python -m dsv4 serve` is told; flag names follow SGLang's where one exists."""

    model: str | None = None  # None: the built-in demo model (dsv4/demo_model)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # resolved to one of DTYPES at construction: see auto_dtype
    page_size: int = 128
    max_running_requests: int = 32
    max_total_tokens: int = 65536  # KV pool size in tokens
    chunked_prefill_size: int = 512  # tokens per tick, shared by decodes (one each) and prefill chunks
    context_length: int | None = None  # None: the model's max_position_embeddings
    kv_cache_dtype: str = "auto"
    index_key_dtype: str = "fp8"
    max_request_bytes: int = 8 << 20
    request_timeout: float = 600.0  # default deadline of a request, seconds
    tick_stall_timeout: float = 5.0  # not ready when ticks stop advancing with work pending this long
    max_queue_wait: float = 60.0  # not ready when the oldest waiting request is older than this
    shutdown_timeout: float = 10.0  # SIGTERM/SIGINT: in-flight requests may finish within this, seconds
    timeout_keep_alive: float = 5.0  # an idle connection, or one still sending its headers, closes after this
    body_read_timeout: float = 30.0  # a request body not fully received in this long gets a 408
    log_level: str = "info"
    fault_inject: str | None = None
    disable_radix_cache: bool = False  # the prefix cache (docs/PREFIX_CACHE.md) is on by default
    # -- the prefix cache's host tier (HiCache; docs/PREFIX_CACHE.md) --
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host pages per device page
    hicache_size: float = 0.0  # host tier size in GB (1e9 bytes); overrides hicache_ratio when > 0
    hicache_write_policy: str = "write_through"  # write_through: on insertion; write_back: on eviction
    # -- device and live cross-checks (owner: dsv4/model, dsv4/kernels) --
    device: str | None = None  # where pools and weights live; None: cuda when available, else cpu
    verify_indexer: str = "off"  # off | count | full | fail: see --verify-indexer's help
    verify_indexer_every: int = 1  # verify the indexer's selections every N ticks
    # torch.compile of the model's many-small-op pieces (dsv4/model/compile.py); off: eager only
    disable_compile: bool = field(default_factory=compile_disabled_by_env)
    compile_timeout: float = 300.0  # seconds the startup compile may take before serving eagerly instead
    cpu_threads: int = 0  # CPU: torch threads of every forward; 0: see dsv4.engine.runner.cpu_forward_threads
    # -- disaggregation (owner: dsv4/disagg; checked in _check_disaggregation) --
    disaggregation_mode: str = "null"  # null: colocated; prefill or decode: one side of a PD pair
    disaggregation_bootstrap_port: int = 8998  # prefill: the UCX port decode instances connect to
    prefill_addr: tuple[str, ...] = ()  # decode: HOST:PORT of each prefill instance's bootstrap port
    verify_transfers: bool = False  # decode: per-page checksums checked before a transfer is used
    # -- tensor/expert parallelism (owner: dsv4/dist; checked in _check_parallelism) --
    tp_size: int = 1  # ranks in lockstep (docs/TENSOR_PARALLEL.md); 1: one process, no collectives
    nnodes: int = 1  # machines the ranks span; ranks are split evenly, node 0 serves HTTP
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT of rank 0's rendezvous; None: a free port on 127.0.0.1
    dist_timeout: float = 30.0  # deadline of every collective, seconds
    dist_join_timeout: float = 120.0  # every rank must have joined the group this long after rank 0 starts

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", auto_dtype(self.device))
        for name, value, allowed in (
            ("dtype", self.dtype, DTYPES),
            ("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES),
            ("index_key_dtype", self.index_key_dtype, INDEX_KEY_DTYPES),
            ("log_level", self.log_level, LOG_LEVELS),
        ):
            if value not in allowed:
                raise ConfigError(f"--{name.replace('_', '-')} {value!r}: expected one of {allowed}")
        if self.page_size <= 0 or self.page_size % 128:
            # Compressed rows (ratio 4 and 128) must align with page boundaries.
            raise ConfigError(f"--page-size {self.page_size} must be a positive multiple of 128")
        for name in ("max_running_requests", "max_total_tokens", "chunked_prefill_size", "max_request_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if self.max_total_tokens < self.page_size:
            raise ConfigError(f"--max-total-tokens {self.max_total_tokens} is less than one page ({self.page_size})")
        if self.chunked_prefill_size < self.max_running_requests:
            # Every running decode takes one token of the tick's budget; a smaller budget could
            # leave some decodes out of every tick.
            raise ConfigError(
                f"--chunked-prefill-size {self.chunked_prefill_size} must be at least "
                f"--max-running-requests {self.max_running_requests}"
            )
        if self.context_length is not None and self.context_length <= 0:
            raise ConfigError("--context-length must be positive")
        for name in ("request_timeout", "tick_stall_timeout", "max_queue_wait", "shutdown_timeout",
                     "timeout_keep_alive", "body_read_timeout", "compile_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if self.cpu_threads < 0:
            raise ConfigError(f"--cpu-threads {self.cpu_threads} must not be negative")
        FaultInjection.parse(self.fault_inject)
        self._check_hicache()
        self._check_verification()
        self._check_disaggregation()
        self._check_parallelism()

    def _check_hicache(self) -> None:
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ConfigError(
                f"--hicache-write-policy {self.hicache_write_policy!r}: expected one of {HICACHE_WRITE_POLICIES}")
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ConfigError("--hicache-ratio must be positive and --hicache-size not negative")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ConfigError("--enable-hierarchical-cache is the radix cache's host tier; "
                              "it cannot be used with --disable-radix-cache")
        if self.enable_hierarchical_cache and self.tp_size > 1:
            # Host copies run on rank 0's pools only; every rank would need its own copies in the plan.
            raise ConfigError("--enable-hierarchical-cache with --tp-size > 1 is not supported yet")

    def _check_verification(self) -> None:
        if self.device is not None and self.device not in DEVICES:
            raise ConfigError(f"--device {self.device!r}: expected one of {DEVICES}")
        if self.verify_indexer not in VERIFY_INDEXER_MODES:
            raise ConfigError(f"--verify-indexer {self.verify_indexer!r}: expected one of {VERIFY_INDEXER_MODES}")
        if self.verify_indexer_every <= 0:
            raise ConfigError(f"--verify-indexer-every {self.verify_indexer_every} must be positive")

    def _check_disaggregation(self) -> None:
        object.__setattr__(self, "prefill_addr", tuple(self.prefill_addr or ()))
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ConfigError(
                f"--disaggregation-mode {self.disaggregation_mode!r}: expected one of {DISAGGREGATION_MODES}"
            )
        if self.disaggregation_mode == "decode" and not self.prefill_addr:
            raise ConfigError("--disaggregation-mode decode needs at least one --prefill-addr HOST:PORT")
        if self.prefill_addr and self.disaggregation_mode != "decode":
            raise ConfigError("--prefill-addr is only meaningful with --disaggregation-mode decode")
        for addr in self.prefill_addr:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--prefill-addr {addr!r}: expected HOST:PORT")
        if not 0 <= self.disaggregation_bootstrap_port < 65536:
            raise ConfigError(f"--disaggregation-bootstrap-port {self.disaggregation_bootstrap_port} is not a port")

    def _check_parallelism(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"--tp-size {self.tp_size} must be at least 1")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ConfigError(f"--nnodes {self.nnodes} must be at least 1 and divide --tp-size {self.tp_size}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT (rank 0's node)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--dist-init-addr {self.dist_init_addr!r}: expected HOST:PORT")
        if self.tp_size > 1 and self.verify_indexer != "off":
            # The verifier re-scores with rank 0's indexer heads only: a partial score.
            raise ConfigError("--tp-size > 1 with --verify-indexer is not supported yet")
        if self.dist_timeout <= 0 or self.dist_join_timeout <= 0:
            raise ConfigError("--dist-timeout and --dist-join-timeout must be positive")

    @property
    def faults(self) -> FaultInjection:
        return FaultInjection.parse(self.fault_inject)

    @staticmethod
    def add_cli_args(parser) -> None:
        d = ServerArgs
        add = parser.add_argument
        add("--model", "--model-path", dest="model", default=d.model,
            help="checkpoint directory; default: the built-in demo model (a small trained DeepSeek-V4)")
        add("--host", default=d.host)
        add("--port", type=int, default=d.port)
        add("--api-key", default=d.api_key, help="require this bearer token on API routes")
        add("--served-model-name", default=d.served_model_name)
        add("--dtype", choices=DTYPE_CHOICES, default=d.dtype,
            help="weights and activations; auto: bfloat16 on CUDA and on CPUs with fast bf16 matmul "
                 "(AVX512-BF16 or AMX), else float32 (faster than bf16 on such CPUs)")
        add("--page-size", type=int, default=d.page_size, help="tokens per KV page (a multiple of 128)")
        add("--max-running-requests", type=int, default=d.max_running_requests)
        add("--max-total-tokens", type=int, default=d.max_total_tokens, help="KV pool size in tokens")
        add("--chunked-prefill-size", type=int, default=d.chunked_prefill_size, help="token budget per tick")
        add("--context-length", type=int, default=d.context_length)
        add("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype)
        add("--index-key-dtype", choices=INDEX_KEY_DTYPES, default=d.index_key_dtype)
        add("--max-request-bytes", type=int, default=d.max_request_bytes)
        add("--request-timeout", type=float, default=d.request_timeout, help="default request deadline, seconds")
        add("--tick-stall-timeout", type=float, default=d.tick_stall_timeout,
            help="not ready when ticks stop advancing with work pending this long, seconds")
        add("--max-queue-wait", type=float, default=d.max_queue_wait,
            help="not ready when the oldest waiting request is older than this, seconds")
        add("--shutdown-timeout", type=float, default=d.shutdown_timeout,
            help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they end with an error")
        add("--timeout-keep-alive", type=float, default=d.timeout_keep_alive,
            help="seconds before an idle connection, or one that has not finished its headers, is closed")
        add("--body-read-timeout", type=float, default=d.body_read_timeout,
            help="seconds a client may take to send a request body (408 after)")
        add("--log-level", choices=LOG_LEVELS, default=d.log_level)
        add("--fault-inject", default=d.fault_inject, help=argparse.SUPPRESS)  # test-only: out of --help
        add("--disable-radix-cache", action="store_true",
            help="turn off the prefix cache (shared prompt prefixes are then recomputed by every request)")
        add("--enable-hierarchical-cache", action="store_true",
            help="give the prefix cache a host tier: pages evicted from the device pool move to host memory "
                 "and are loaded back on a hit")
        add("--hicache-ratio", type=float, default=d.hicache_ratio,
            help="host tier size as a multiple of the device pool's pages")
        add("--hicache-size", type=float, default=d.hicache_size,
            help="host tier size in GB; overrides --hicache-ratio when positive")
        add("--hicache-write-policy", choices=HICACHE_WRITE_POLICIES, default=d.hicache_write_policy,
            help="write_through: copy a page to the host tier when it joins the cache; write_back: when it "
                 "is evicted from the device pool")
        # -- device and live cross-checks --
        add("--device", choices=DEVICES, default=d.device,
            help="where the model's weights and state live (default: cuda when available, else cpu)")
        add("--verify-indexer", nargs="?", const="count", choices=VERIFY_INDEXER_MODES, default=d.verify_indexer,
            help="re-run the reference indexer on the cached state and compare its top-k with the fast path's; "
                 "count (the default when given without a value): count and log disagreements; full: as count, "
                 "with the index queries and head weights also recomputed from the layer input by reference "
                 "code (slower); fail: as count, and also fail the affected request")
        add("--verify-indexer-every", type=int, default=d.verify_indexer_every, metavar="N",
            help="with --verify-indexer: verify every N ticks")
        add("--disable-compile", action="store_true", default=compile_disabled_by_env(),
            help="run the model eagerly: no torch.compile of its many-small-op pieces at startup "
                 "(default from DSV4_DISABLE_COMPILE)")
        add("--compile-timeout", type=float, default=d.compile_timeout,
            help="seconds the startup compile may take; past it the model serves eagerly (logged)")
        add("--cpu-threads", type=int, default=d.cpu_threads, metavar="N",
            help="CPU: torch threads of every forward (decode steps included); 0 (default): torch's count, "
                 "i.e. every core this process may use (or OMP_NUM_THREADS), shared evenly among this node's "
                 "--tp-size ranks. Engine processes that share cores need a share each (a prefill and a decode "
                 "instance on one machine: half each): their OpenMP workers spin, and would wait on each other")
        # -- disaggregation --
        add("--disaggregation-mode", choices=DISAGGREGATION_MODES, default=d.disaggregation_mode,
            help="null: serve alone; prefill: compute prompts for decode instances; decode: serve users, "
                 "prefill remotely")
        add("--disaggregation-bootstrap-port", type=int, default=d.disaggregation_bootstrap_port,
            help="prefill mode: UCX port that decode instances connect to")
        add("--prefill-addr", action="append", default=None, metavar="HOST:PORT",
            help="decode mode: a prefill instance's bootstrap address (repeatable)")
        add("--verify-transfers", action="store_true",
            help="decode mode: check per-page checksums of every transfer before using it; with "
                 "--enable-hierarchical-cache also check every page loaded from the host tier")
        # -- tensor/expert parallelism --
        add("--tp-size", type=int, default=d.tp_size,
            help="ranks that shard the model and run each tick in lockstep (one process each, started by this one)")
        add("--nnodes", type=int, default=d.nnodes, help="machines the --tp-size ranks span (one serve per machine)")
        add("--node-rank", type=int, default=d.node_rank, help="this machine's index; node 0 serves HTTP")
        add("--dist-init-addr", default=d.dist_init_addr, metavar="HOST:PORT",
            help="rank 0's rendezvous address (needed with --nnodes > 1)")
        add("--dist-timeout", type=float, default=d.dist_timeout,
            help="seconds any collective may take before the group stops, naming the rank")
        add("--dist-join-timeout", type=float, default=d.dist_join_timeout,
            help="seconds every rank (every node) has to join the group at startup before it fails, naming them")

    @classmethod
    def from_cli(cls, namespace) -> ServerArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(namespace).items() if k in names})
