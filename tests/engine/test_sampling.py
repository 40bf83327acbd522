import torch

from dsv4.engine.sampling import noise_seed, sample, stop_reason
from dsv4.protocol import SamplingParams

VOCAB = 50


def logits(batch=4, seed=0):
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    x = logits()
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(x, params, [0] * 4) == x.argmax(-1).tolist()


def test_top_k_one_is_greedy_at_any_temperature():
    x = logits()
    params = [SamplingParams(temperature=5.0, top_k=1)] * 4
    assert sample(x, params, [0] * 4) == x.argmax(-1).tolist()


def test_seeded_requests_reproduce_whatever_the_batch():
    x = logits(batch=3)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(x[:1], [seeded], [p])[0] for p in range(20)]
    neighbours = [seeded, SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    in_batch = [sample(x, neighbours, [p, p + 1, 7])[0] for p in range(20)]
    assert alone == in_batch
    assert len(set(alone)) > 1  # it does sample


def test_seeded_noise_is_a_function_of_seed_and_position_only():
    """A retracted request samples its next token again after a recompute: same (seed, position),
    same token, whatever was drawn in between."""
    x = logits(batch=1)
    seeded = SamplingParams(temperature=1.0, seed=7)
    forward = [sample(x, [seeded], [p])[0] for p in range(100, 140)]
    backward = [sample(x, [seeded], [p])[0] for p in reversed(range(100, 140))][::-1]
    assert forward == backward
    other_seed = [sample(x, [SamplingParams(temperature=1.0, seed=8)], [p])[0] for p in range(100, 140)]
    assert other_seed != forward


def test_noise_seeds_are_in_the_generator_range_for_any_seed():
    seeds = {noise_seed(seed, p) for seed in (0, 1, -1, 2**62, -(2**63)) for p in (0, 1, 2**40)}
    assert len(seeds) == 15 and all(0 <= s < 2**64 for s in seeds)
    for s in seeds:
        torch.Generator().manual_seed(s)


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = [SamplingParams(temperature=1.0, top_p=0.8, seed=0)]
    seen = {sample(probs.log(), params, [p])[0] for p in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.8; tokens 2 and 3 are cut


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)  # unseeded requests draw from torch's default generator
    probs = torch.tensor([0.7, 0.2, 0.1])
    draws = sample(probs.log().expand(4000, 3), [SamplingParams(temperature=1.0)] * 4000, [0] * 4000)
    assert torch.allclose(torch.bincount(torch.tensor(draws), minlength=3) / 4000.0, probs, atol=0.03)


def test_top_k_limits_the_candidates():
    x = logits(batch=1)
    params = [SamplingParams(temperature=10.0, top_k=3, seed=9)]
    seen = {sample(x, params, [p])[0] for p in range(200)}
    assert seen <= set(x[0].topk(3).indices.tolist()) and len(seen) == 3


def test_stop_reasons():
    eos = frozenset({1})
    p = SamplingParams(max_new_tokens=3, stop_token_ids=(9,))
    assert stop_reason(1, 1, p, eos) == "stop"
    assert stop_reason(9, 1, p, eos) == "stop"
    assert stop_reason(5, 2, p, eos) is None
    assert stop_reason(5, 3, p, eos) == "length"
    assert stop_reason(1, 1, SamplingParams(ignore_eos=True), eos) is None


def plain_processors(row: list[float], p: SamplingParams, prompt: list[int], generated: list[int]) -> list[float]:
    """One row, one token at a time, as the OpenAI and vLLM docs describe the processors."""
    row = list(row)
    for token, bias in p.logit_bias:
        row[token] += bias
    for token in set(prompt) | set(generated):
        row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    for token in set(generated):
        row[token] -= p.frequency_penalty * generated.count(token) + p.presence_penalty
    return row


PROCESSED = [
    SamplingParams(temperature=0.0, presence_penalty=1.5),
    SamplingParams(temperature=0.0, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, frequency_penalty=-0.4, presence_penalty=-2.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, repetition_penalty=0.6),
    SamplingParams(temperature=0.0, logit_bias=((3, 100.0), (7, -100.0), (3, -1.0))),
    SamplingParams(temperature=0.0, logit_bias=((9, 2.5),), repetition_penalty=1.3, frequency_penalty=0.2,
                   presence_penalty=0.1),
    SamplingParams(temperature=0.0),  # untouched in the same batch
]


def test_processors_match_a_plain_implementation():
    from dsv4.engine.sampling import apply_processors

    x = logits(batch=len(PROCESSED), seed=3) * 3
    prompt, generated = [1, 2, 2, 9, 40], [7, 7, 7, 3, 11, 2, 9]
    histories = [(prompt, generated)] * len(PROCESSED)
    got = apply_processors(x, PROCESSED, histories)
    for i, p in enumerate(PROCESSED):
        want = torch.tensor(plain_processors(x[i].tolist(), p, prompt, generated))
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5)
    assert torch.equal(got[-1], x[-1])
    # and greedy sampling follows the processed logits
    assert sample(x, PROCESSED, [0] * len(PROCESSED), histories) == got.argmax(-1).tolist()
    assert sample(x, PROCESSED, [0] * len(PROCESSED), histories)[5] == 3  # the +100 bias wins


def test_processors_cost_nothing_without_them():
    from dsv4.engine.sampling import apply_processors

    x = logits()
    assert apply_processors(x, [SamplingParams()] * 4, [None] * 4) is x


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = [SamplingParams(temperature=1.0, min_p=0.35, seed=0)]  # keeps p >= 0.175
    seen = {sample(probs.log(), params, [p])[0] for p in range(300)}
    assert seen == {0, 1}
    everything = {sample(probs.log(), [SamplingParams(temperature=1.0, seed=0)], [p])[0] for p in range(300)}
    assert everything == {0, 1, 2, 3}


def test_a_tiny_temperature_is_greedy():
    x = logits()
    assert sample(x, [SamplingParams(temperature=1e-300, seed=1)] * 4, [0] * 4) == x.argmax(-1).tolist()
