"""The model runner: owns the state pools and the production model, runs one ForwardBatch per tick.

Before anything is written, a batch is checked whole: well-formed chunks, distinct slots, page
tables that cover the chunk, and every page and slot generation bound through the pools (a stale
one raises `StaleReference`). A chunk with start_pos == 0 starts its slot empty; nothing else
resets a slot, so a slot needs no release.

Pools and weights live on `--device`; the sampled logits come back on the CPU. The logits of
prompt positions (chunks with `prompt_logits_from`, for prompt logprobs) stay on the device, as
`prompt_logits`, for the tick to reduce to logprobs there. With `--verify-indexer`, every
`--verify-indexer-every` ticks the forward's indexer selections are checked against the reference
(`dsv4.engine.indexer_check`; with `full`, from queries the reference recomputes); the result is
`indexer_check`, beside the logits.
"""

from __future__ import annotations

import torch

from dsv4.config import ModelConfig, cache_dir
from dsv4.memory.pools import StatePools
from dsv4.model.compile import compile_pieces
from dsv4.model.model import PagedModel
from dsv4.model.plan import DecodePlanner, build_plan
from dsv4.model.sharding import Reducer, ShardPlan
from dsv4.protocol import ForwardBatch

from .host_malloc import retain_freed_memory
from .indexer_check import IndexerVerifier, IndexQueryOracle

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def cpu_forward_threads(args) -> int:
    """Torch threads of every CPU forward: `--cpu-threads`, or torch's count on the calling thread (every
    core the process may use, or OMP_NUM_THREADS) shared evenly among this node's ranks, at least one:
    ranks on the same cores with more workers than cores between them would each spin waiting on a
    descheduled peer (dsv4.engine.launch.load_model)."""
    return args.cpu_threads or max(1, torch.get_num_threads() // (args.tp_size // args.nnodes))


def resolve_device(device: str | None) -> torch.device:
    """`--device`, where None means cuda when torch sees a GPU, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    return torch.device(device)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], args, *, kernels: bool | None = None,
                 shard: ShardPlan | None = None, reduce: Reducer | None = None):
        """`args`: a ServerArgs (dtype, page_size, max_running_requests, max_total_tokens, kv_cache_dtype,
        index_key_dtype, device, verify_indexer, verify_indexer_every are read). `kernels`: run the
        model through `dsv4.kernels.dispatch` (default: on CUDA; see PagedModel). Under tensor
        parallelism, `weights` are this rank's part (`shard`) and `reduce` sums across ranks."""
        self.cfg = cfg
        self.dtype = TORCH_DTYPES[args.dtype]
        self.device = resolve_device(args.device)
        if self.device.type == "cpu":
            retain_freed_memory()
        self.page_size = args.page_size
        self.num_pages = args.max_total_tokens // args.page_size
        self.num_slots = args.max_running_requests
        # Prefix cache boundary snapshots, one per page it may cache; slot-sized units after the slots.
        self.num_snapshots = 0 if args.disable_radix_cache else self.num_pages
        self.verify_indexer = args.verify_indexer != "off"
        self.verify_indexer_every = args.verify_indexer_every
        self.pools = StatePools(cfg, num_pages=self.num_pages, num_slots=self.num_slots + self.num_snapshots,
                                page_size=self.page_size,
                                dtype=self.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                index_key_dtype=args.index_key_dtype, device=self.device,
                                fingerprint_index_keys=self.verify_indexer)
        # CPU forwards run on this many threads, decode steps too: their products, as one-row matmuls
        # over both cores, read the weights at up to twice one core's pace (`small`, 2 cores, c=1 decode
        # step: fp32 22.3 ms against 34.4 on one thread, bf16 22.1 against 26.0). That pays only while
        # the forward thread alone holds OpenMP workers (dsv4.engine.launch.load_model): with a second
        # thread's idle workers it cost more than it saved (fp32 36 ms).
        self.cpu_threads = cpu_forward_threads(args)
        self.model = PagedModel(cfg, weights, self.dtype, self.pools, kernels=kernels, shard=shard, reduce=reduce)
        if not args.disable_compile:  # for this model's shapes: its weights are the examples
            self.model.pieces = compile_pieces(self.model, args.compile_timeout, cache_dir() / "compiled",
                                             self.cpu_threads)
        self.compiled = self.model.pieces.compiled
        self.decode_planner = DecodePlanner(cfg, self.page_size)
        self.index_query_oracle = (IndexQueryOracle(cfg, weights, self.dtype, self.device)
                                   if args.verify_indexer == "full" else None)
        self.indexer_check: IndexerVerifier | None = None  # of the last forward, when it was verified
        # Of the last forward: [rows of every chunk's prompt_logit_positions, vocab] on the device.
        self.prompt_logits: torch.Tensor | None = None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs every chunk (prefill chunks and decode tokens mixed), writes their rows into the
        pools, returns float32 logits [number of chunks with sample=True, vocab] in chunk order."""
        self._check(batch)
        self.indexer_check = self.prompt_logits = None
        self._copy_slots(batch.restores)
        logits = self._forward(batch)
        self._copy_slots(batch.snapshots)
        return logits

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if not batch.chunks:
            return torch.zeros((0, self.cfg.vocab_size), dtype=torch.float32)
        if self.device.type == "cpu":  # this thread runs the forward: the setting is the calling thread's
            torch.set_num_threads(self.cpu_threads)
        verified = self.verify_indexer and batch.tick % self.verify_indexer_every == 0
        if not verified and any(self.model.fused):  # a step whose every layer is one C call needs no more
            decode = self.decode_planner.plan(batch)
            if decode is not None and self.model.runs_fused(decode):
                return self.model.forward(decode).cpu()
        plan = build_plan(self.cfg, batch, self.page_size)
        if self.device.type != "cpu":
            plan = plan.to(self.device)
        verifier = None
        if verified:
            verifier = IndexerVerifier(plan, self.pools, self.cfg.index_topk, self.index_query_oracle)
        logits = self.model.forward(plan, verifier)
        self.indexer_check = verifier
        sampled = len(plan.sample_tokens)
        if len(plan.prompt_tokens):
            self.prompt_logits = logits[sampled:]
        return logits[:sampled].cpu()

    def begin_tenancies(self, page_handouts, slot_handouts) -> None:
        """A plan's allocator handouts, before its installs and forward name them."""
        self.pools.begin_tenancies(page_handouts, slot_handouts)

    def _copy_slots(self, copies) -> None:
        """Prefix cache: slot-sized units copied whole (slot <-> boundary snapshot), generations checked."""
        for c in copies:
            src = self.pools.slot_view(c.src, c.src_generation)
            self.pools.slot_view(c.dst, c.dst_generation).copy_(src)

    def _chunk_problem(self, c) -> str | None:
        """What makes chunk `c` unrunnable here, if anything."""
        if not 0 <= c.slot < self.num_slots:
            return f"slot {c.slot} outside 0..{self.num_slots - 1}"
        if not c.token_ids or c.start_pos < 0:
            return f"empty chunk or negative start_pos {c.start_pos}"
        if not 0 <= min(c.token_ids) <= max(c.token_ids) < self.cfg.vocab_size:
            return f"token ids outside 0..{self.cfg.vocab_size - 1}"
        if len(c.page_ids) != len(c.page_generations):
            return f"{len(c.page_ids)} pages but {len(c.page_generations)} generations"
        end = c.start_pos + len(c.token_ids)
        if len(c.page_ids) * self.page_size < end:
            return f"{len(c.page_ids)} pages of {self.page_size} cannot hold {end} tokens"
        if c.page_ids and not 0 <= min(c.page_ids) <= max(c.page_ids) < self.num_pages:
            return f"page ids outside 0..{self.num_pages - 1}"
        return None

    def _check(self, batch: ForwardBatch) -> None:
        slots = [c.slot for c in batch.chunks]
        if len(set(slots)) != len(slots):
            raise ValueError(f"tick {batch.tick}: chunks share a slot: {slots}")
        for c in batch.chunks:
            problem = self._chunk_problem(c)
            if problem:
                raise ValueError(f"tick {batch.tick}, request {c.rid}: {problem}")
        self.pools.bind_pages([p for c in batch.chunks for p in c.page_ids],
                              [g for c in batch.chunks for g in c.page_generations])
        self.pools.bind_slots([c.slot for c in batch.chunks], [c.slot_generation for c in batch.chunks])
        chunk_of = {c.slot: c for c in batch.chunks}
        for capture in batch.captures:
            c = chunk_of.get(capture.slot)
            where = f"tick {batch.tick}, capture at {capture.position} of slot {capture.slot}"
            if c is None or capture.position % self.page_size:
                raise ValueError(f"{where}: no chunk in that slot, or not a page boundary")
            if not c.start_pos + self.cfg.sliding_window <= capture.position < c.start_pos + len(c.token_ids):
                raise ValueError(f"{where}: not a window past the chunk's start and inside it")
            if not self.num_slots <= capture.unit < self.num_slots + self.num_snapshots:
                raise ValueError(f"{where}: unit {capture.unit} is not a snapshot unit")
            self.pools.bind_slot(capture.unit, capture.unit_generation)
