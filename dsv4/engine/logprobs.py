"""Log-probabilities of chosen tokens and of the most likely alternatives, from raw logits.

Taken before every logits processor and before temperature (vLLM's default, `raw_logprobs`): the
fp32 log_softmax over the whole vocabulary of the logits the model produced. Computed on the
logits' device, one batched log_softmax and top-k for all the rows that asked; only the chosen
values travel to the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.protocol import ForwardChunk, TokenLogprob

MAX_TOP_LOGPROBS = 20  # the most alternatives any route asks for (OpenAI chat's limit)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], tops: Sequence[int]) -> list[TokenLogprob]:
    """Row i: the logprob of `token_ids[i]` under `logits[i]`, with its `tops[i]` most likely tokens."""
    if not len(token_ids):
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
    k = max(tops)
    if k:
        top_values, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    rows = []
    for i, (token, logprob, n) in enumerate(zip(token_ids, chosen, tops, strict=True)):
        top = tuple(zip(top_ids[i][:n], top_values[i][:n], strict=True)) if n else ()
        rows.append(TokenLogprob(int(token), logprob, top))
    return rows


@dataclass(frozen=True)
class PromptLogprobJob:
    """One chunk's prompt logprobs: the tokens that follow its `prompt_logit_positions` (the token at
    position p + 1 for the logits at p), and how many alternatives its request asked for."""

    rid: str
    targets: tuple[int, ...]
    top: int


def prompt_jobs(chunks: Sequence[ForwardChunk], prompts: dict[str, tuple[int, ...]],
                tops: dict[str, int]) -> list[PromptLogprobJob]:
    """The jobs of a batch's chunks that return prompt logits, in chunk order; `prompts[rid]` is the
    request's prompt."""
    return [PromptLogprobJob(c.rid, tuple(prompts[c.rid][p + 1] for p in positions), tops[c.rid])
            for c in chunks if (positions := c.prompt_logit_positions())]


def prompt_logprobs(logits: torch.Tensor | None, jobs: Sequence[PromptLogprobJob]) -> dict[str, list[TokenLogprob]]:
    """rid -> the logprobs of each job's targets, from the runner's `prompt_logits` (jobs' rows in order)."""
    if not jobs:
        return {}
    targets = [t for job in jobs for t in job.targets]
    if logits is None or logits.shape[0] != len(targets):
        raise RuntimeError(f"the runner returned {0 if logits is None else logits.shape[0]} prompt logit rows "
                           f"for {len(targets)} prompt positions")
    rows = token_logprobs(logits, targets, [job.top for job in jobs for _ in job.targets])
    out: dict[str, list[TokenLogprob]] = {}
    first = 0
    for job in jobs:
        out[job.rid] = rows[first:first + len(job.targets)]
        first += len(job.targets)
    return out
