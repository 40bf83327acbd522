"""Token sampling over a batch of logits, and the token-level stop rules.

Non-greedy rows sample by the exponential race (argmax of p / E with E ~ Exp(1)), which draws
exactly from p and lets each request's noise come from its own seeded generator: a seeded
request's tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from dsv4.protocol import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.seed is None or params.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed)
    return gen


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token id per row of float `logits` [batch, vocab]; `generators[i]` None uses torch's
    default generator."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        tokens[rows] = _sample_rows(logits[rows].float(), [params[i] for i in rows], [generators[i] for i in rows])
    return tokens.tolist()


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    vocab = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)

    sorted_logits, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
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
