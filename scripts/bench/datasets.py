"""Benchmark prompts as token ids, drawn from byte tokens [16, 256) so any byte-level vocabulary
holds them and none is a special token.

random                   every prompt exactly `input_len` random tokens (equal lengths let HF's
                         batched generate run them without padding)
generated-shared-prefix  `num_groups` system prefixes of `system_len` tokens, each shared by
                         `prompts_per_group` prompts with their own `question_len`-token tail,
                         shuffled (SGLang's generated-shared-prefix); lengths equal too
"""

from __future__ import annotations

import random

DATASETS = ("random", "generated-shared-prefix")
LOW, HIGH = 16, 256


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(LOW, HIGH) for _ in range(n)]


def random_prompts(n: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [_tokens(rng, input_len) for _ in range(n)]


def shared_prefix_prompts(num_groups: int, prompts_per_group: int, system_len: int, question_len: int,
                          seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_groups):
        system = _tokens(rng, system_len)
        prompts += [system + _tokens(rng, question_len) for _ in range(prompts_per_group)]
    rng.shuffle(prompts)
    return prompts
