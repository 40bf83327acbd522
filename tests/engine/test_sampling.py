import torch

from dsv4.engine.sampling import make_generator, sample, stop_reason
from dsv4.protocol import SamplingParams

VOCAB = 50


def logits(batch=4, seed=0):
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    x = logits()
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(x, params, [None] * 4) == x.argmax(-1).tolist()


def test_top_k_one_is_greedy_at_any_temperature():
    x = logits()
    params = [SamplingParams(temperature=5.0, top_k=1)] * 4
    assert sample(x, params, [None] * 4) == x.argmax(-1).tolist()


def test_seeded_requests_reproduce_whatever_the_batch():
    x = logits(batch=3)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    gen = make_generator(seeded)
    alone = [sample(x[:1], [seeded], [gen])[0] for _ in range(20)]
    gen = make_generator(seeded)
    neighbours = [seeded, SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    in_batch = [sample(x, neighbours, [gen, None, None])[0] for _ in range(20)]
    assert alone == in_batch
    assert len(set(alone)) > 1  # it does sample


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = [SamplingParams(temperature=1.0, top_p=0.8, seed=0)]
    gen = make_generator(params[0])
    seen = {sample(probs.log(), params, [gen])[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.8; tokens 2 and 3 are cut


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)  # unseeded requests draw from torch's default generator
    probs = torch.tensor([0.7, 0.2, 0.1])
    draws = sample(probs.log().expand(4000, 3), [SamplingParams(temperature=1.0)] * 4000, [None] * 4000)
    assert torch.allclose(torch.bincount(torch.tensor(draws), minlength=3) / 4000.0, probs, atol=0.03)


def test_top_k_limits_the_candidates():
    x = logits(batch=1)
    params = [SamplingParams(temperature=10.0, top_k=3, seed=9)]
    gen = make_generator(params[0])
    seen = {sample(x, params, [gen])[0] for _ in range(200)}
    assert seen <= set(x[0].topk(3).indices.tolist()) and len(seen) == 3


def test_stop_reasons():
    eos = frozenset({1})
    p = SamplingParams(max_new_tokens=3, stop_token_ids=(9,))
    assert stop_reason(1, 1, p, eos) == "stop"
    assert stop_reason(9, 1, p, eos) == "stop"
    assert stop_reason(5, 2, p, eos) is None
    assert stop_reason(5, 3, p, eos) == "length"
    assert stop_reason(1, 1, SamplingParams(ignore_eos=True), eos) is None
