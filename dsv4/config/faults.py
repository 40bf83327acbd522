"""Test-only fault injection (`--fault-inject`), parsed into a FaultInjection the engine and the
disaggregation layer read."""

from __future__ import annotations

from dataclasses import dataclass

from dsv4.config.model import ConfigError

# -- host-tier copy delays (owner: dsv4/cache/hicache.py) ----------------------------------------

COPY_KINDS = ("hicache_load", "hicache_write")
_COPY_DELAY_FORM = "delay:hicache_load|hicache_write:P:DURATION"


@dataclass(frozen=True)
class CopyDelay:
    """A host-tier copy job of `kind` becomes runnable `seconds` after its submission, with
    `probability`; later jobs overtake it (the copy thread runs the earliest runnable job), so
    delays also reorder completions."""

    kind: str
    probability: float
    seconds: float


def parse_copy_delay(item: str) -> CopyDelay:
    try:
        _, kind, probability, duration = item.split(":")
        if kind not in COPY_KINDS:
            raise ValueError(f"unknown copy kind {kind!r}")
        delay = CopyDelay(kind, float(probability), parse_duration(duration))
        if not 0.0 <= delay.probability <= 1.0:
            raise ValueError(f"probability {delay.probability} outside 0..1")
        return delay
    except ValueError as e:
        raise ConfigError(f"--fault-inject {item!r}: {e}; expected {_COPY_DELAY_FORM}") from None


# -- transfer faults (owner: dsv4/disagg) ---------------------------------------------------------

FRAME_KINDS = (
    "hello", "hello_ack", "prefill", "payload", "commit", "abort", "abort_ack", "drain", "drain_ack", "heartbeat",
)
_FRAME_FAULT_ACTIONS = ("drop", "delay", "duplicate", "corrupt")
_TRANSFER_FAULT_FORMS = (
    "drop|duplicate|corrupt:KIND:P, delay:KIND:P:DURATION, stall:prefill:DURATION, kill:transfer_task "
    "(KIND: a frame kind or *)"
)


@dataclass(frozen=True)
class FrameFault:
    """Sender-side fault on frames of one kind (`*`: every kind), each hit with `probability`:
    drop (a payload's header and body together), delay (keeping the sender's order), duplicate,
    corrupt (one byte flipped after the checksum was taken)."""

    action: str
    kind: str
    probability: float
    delay_seconds: float = 0.0


RANK_PHASES = ("plan", "forward", "consensus")
_RANK_DELAY_FORM = "delay:rankR:PHASE:P:DURATION (PHASE: plan, forward or consensus)"


@dataclass(frozen=True)
class RankDelay:
    """Tensor parallelism: rank `rank` sleeps `seconds` with `probability` at `phase` of each tick
    (plan: before receiving or sending the plan; forward: before the forward; consensus: before the
    consensus vector). It must never change an output nor desynchronise the group."""

    rank: int
    phase: str
    probability: float
    seconds: float


def parse_rank_delay(item: str) -> RankDelay:
    try:
        _, rank, phase, probability, duration = item.split(":")
        if not rank.startswith("rank") or not rank[4:].isdigit():
            raise ValueError(f"{rank!r} is not rankR")
        if phase not in RANK_PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        delay = RankDelay(int(rank[4:]), phase, float(probability), parse_duration(duration))
        if not 0.0 <= delay.probability <= 1.0:
            raise ValueError(f"probability {delay.probability} outside 0..1")
        return delay
    except ValueError as e:
        raise ConfigError(f"--fault-inject {item!r}: {e}; expected {_RANK_DELAY_FORM}") from None


def parse_duration(text: str) -> float:
    """"200ms" or "2s" -> seconds."""
    number = text[:-2] if text.endswith("ms") else text[:-1] if text.endswith("s") else None
    try:
        seconds = float(number) / (1000.0 if text.endswith("ms") else 1.0)
    except (TypeError, ValueError):
        raise ValueError(f"duration {text!r}: expected e.g. 200ms or 2s") from None
    if seconds < 0:
        raise ValueError(f"duration {text!r} is negative")
    return seconds


def parse_transfer_fault(item: str, fields: dict) -> None:
    """One `ACTION:...` item of --fault-inject into FaultInjection fields."""
    action, *rest = item.split(":")
    try:
        if action in _FRAME_FAULT_ACTIONS:
            if len(rest) != (3 if action == "delay" else 2):
                raise ValueError("wrong number of fields")
            kind, probability = rest[0], float(rest[1])
            if kind != "*" and kind not in FRAME_KINDS:
                raise ValueError(f"unknown frame kind {kind!r}")
            if not 0.0 <= probability <= 1.0:
                raise ValueError(f"probability {probability} outside 0..1")
            delay = parse_duration(rest[2]) if action == "delay" else 0.0
            fields["frame_faults"] = (*fields.get("frame_faults", ()), FrameFault(action, kind, probability, delay))
        elif action == "stall" and len(rest) == 2 and rest[0] == "prefill":
            fields["stall_prefill_seconds"] = parse_duration(rest[1])
        elif action == "kill" and rest == ["transfer_task"]:
            fields["kill_transfer_task"] = True
        else:
            raise ValueError("unknown fault")
    except ValueError as e:
        raise ConfigError(f"--fault-inject {item!r}: {e}; expected {_TRANSFER_FAULT_FORMS}") from None


@dataclass(frozen=True)
class FaultInjection:
    """Test-only faults, parsed from `--fault-inject`: comma-separated `stall_tick=SECONDS@TICK`
    (the forward of tick TICK sleeps SECONDS first, as a wedged collective would) and
    `crash_tick=TICK` (tick TICK raises, killing the tick loop), `delay:rankR:...` (RankDelay) and
    `delay:hicache_load|hicache_write:...` (CopyDelay)."""

    stall_seconds: float = 0.0
    stall_at_tick: int | None = None
    crash_at_tick: int | None = None
    # Transfer faults (`ACTION:...` items; see parse_transfer_fault below).
    frame_faults: tuple[FrameFault, ...] = ()
    stall_prefill_seconds: float = 0.0
    kill_transfer_task: bool = False
    rank_delays: tuple[RankDelay, ...] = ()
    copy_delays: tuple[CopyDelay, ...] = ()

    @classmethod
    def parse(cls, spec: str | None) -> FaultInjection:
        fields: dict = {}
        for item in filter(None, (part.strip() for part in (spec or "").split(","))):
            if item.startswith("delay:rank"):
                fields["rank_delays"] = (*fields.get("rank_delays", ()), parse_rank_delay(item))
                continue
            if item.startswith("delay:hicache_"):
                fields["copy_delays"] = (*fields.get("copy_delays", ()), parse_copy_delay(item))
                continue
            if ":" in item:
                parse_transfer_fault(item, fields)
                continue
            name, _, value = item.partition("=")
            try:
                if name == "stall_tick":
                    seconds, _, tick = value.partition("@")
                    fields.update(stall_seconds=float(seconds), stall_at_tick=int(tick))
                elif name == "crash_tick":
                    fields["crash_at_tick"] = int(value)
                else:
                    raise ValueError(f"unknown fault {name!r}")
            except ValueError as e:
                raise ConfigError(
                    f"--fault-inject {item!r}: {e}; expected stall_tick=SECONDS@TICK or crash_tick=TICK"
                ) from None
        return cls(**fields)
