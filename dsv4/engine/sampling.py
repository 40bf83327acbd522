"""Token sampling over a batch of logits, and the token-level stop rules.

Non-greedy rows sample by the exponential race (argmax of p / E with E ~ Exp(1)), which draws
exactly from p and lets each seeded request's noise come from a generator of its own, seeded with
a hash of (seed, position of the token being sampled): a seeded request's tokens depend neither on
what else is in the batch nor on how its tokens were computed (a retracted request recomputes
its rows and must continue exactly as it would have).

Logits processors run first, on the rows that ask for them only, in vLLM's order: `logit_bias`,
then the repetition penalty (over prompt and generated tokens: a positive logit is divided by it,
a negative one multiplied), then the frequency and presence penalties (over generated tokens:
subtracted per occurrence and once). Greedy rows see them too. `min_p` then drops tokens whose
probability, after temperature, is below min_p times the top token's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4.protocol import SamplingParams

_MASK64 = 2**64 - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, position: int) -> int:
    """The generator seed of the token at `position` of a request seeded with `seed`: in [0, 2**64),
    the range torch.Generator.manual_seed takes."""
    return _splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64)


History = tuple[Sequence[int], Sequence[int]]  # (prompt ids, generated ids) of one request


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           histories: list[History | None] | None = None) -> list[int]:
    """One token id per row of float `logits` [batch, vocab]; `positions[i]` is where row i's token
    will stand in its sequence; `histories[i]` what row i has seen, needed only where its
    penalties are set. Unseeded rows draw from torch's default generator."""
    logits = apply_processors(logits, params, histories or [None] * len(params))
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        generators = [_generator(params[i], positions[i]) for i in rows]
        tokens[rows] = _sample_rows(logits[rows].float(), [params[i] for i in rows], generators)
    return tokens.tolist()


def apply_processors(logits: torch.Tensor, params: list[SamplingParams],
                     histories: list[History | None]) -> torch.Tensor:
    """`logits` with each row's bias and penalties applied (the same tensor when no row has any)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias or p.needs_history]
    if not rows:
        return logits
    logits = logits.clone()
    device, dtype = logits.device, logits.dtype
    biased = [(i, token, bias) for i in rows for token, bias in params[i].logit_bias]
    if biased:
        row, token, bias = zip(*biased, strict=True)
        logits.index_put_((torch.tensor(row, device=device), torch.tensor(token, device=device)),
                          torch.tensor(bias, device=device, dtype=dtype), accumulate=True)
    penalized = [i for i in rows if params[i].needs_history]
    if not penalized:
        return logits
    for i in penalized:
        if histories[i] is None:
            raise ValueError(f"row {i} has penalties but no token history")
    vocab = logits.shape[1]
    index = torch.tensor(penalized, device=device)
    x = logits[index]
    generated = _token_counts([histories[i][1] for i in penalized], vocab, device, dtype)
    seen = _token_counts([[*histories[i][0], *histories[i][1]] for i in penalized], vocab, device, dtype) > 0
    repetition = torch.tensor([params[i].repetition_penalty for i in penalized], device=device, dtype=dtype)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    frequency = torch.tensor([params[i].frequency_penalty for i in penalized], device=device, dtype=dtype)
    presence = torch.tensor([params[i].presence_penalty for i in penalized], device=device, dtype=dtype)
    x = x - frequency[:, None] * generated - presence[:, None] * (generated > 0).to(dtype)
    logits[index] = x
    return logits


def _token_counts(sequences: list[Sequence[int]], vocab: int, device, dtype) -> torch.Tensor:
    """[len(sequences), vocab]: how often each id occurs in each sequence."""
    counts = torch.zeros(len(sequences), vocab, device=device, dtype=dtype)
    rows = torch.tensor([r for r, seq in enumerate(sequences) for _ in seq], dtype=torch.long, device=device)
    ids = torch.tensor([t for seq in sequences for t in seq], dtype=torch.long, device=device)
    counts.index_put_((rows, ids), torch.ones(len(ids), device=device, dtype=dtype), accumulate=True)
    return counts


def _generator(params: SamplingParams, position: int) -> torch.Generator | None:
    if params.seed is None:
        return None
    return torch.Generator().manual_seed(noise_seed(params.seed, position))


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
    vocab = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype)

    sorted_logits, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
    if (min_p > 0).any():  # sorted: column 0 holds the top token
        first = sorted_logits.softmax(dim=-1)
        sorted_logits.masked_fill_(first < min_p[:, None] * first[:, :1], float("-inf"))
    rank = torch.arange(vocab)
    sorted_logits.masked_fill_(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it does.
    mass_before = probs.cumsum(dim=-1) - probs
    probs.masked_fill_(mass_before >= top_p[:, None], 0.0)
    probs[:, 0] = probs[:, 0].clamp_min(torch.finfo(probs.dtype).tiny)  # the top token always survives

    noise = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        noise[shared] = torch.empty(len(shared), vocab, dtype=probs.dtype).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # a zero draw would turn a masked 0 / 0 into NaN
    choice = (probs / noise).argmax(dim=-1)
    return order.gather(1, choice[:, None]).squeeze(1)


def stop_reason(token: int, num_generated: int, params: SamplingParams, eos_ids: frozenset[int]) -> str | None:
    """Why generation ends after `token` (the `num_generated`-th new token), or None."""
    if token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos):
        return "stop"
    if num_generated >= params.max_new_tokens:
        return "length"
    return None
