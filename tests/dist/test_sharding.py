"""The sharding plan: which part of each tensor a rank keeps, and clear refusals of TP sizes that do
not divide the model; each rank reads only its own routed experts."""

import dataclasses

import pytest
import torch

import dsv4.weights
from dsv4.config import ConfigError, ModelConfig
from dsv4.model.sharding import ShardPlan
from dsv4.tiny import tiny_config


def test_tp_size_must_divide_heads_groups_indexer_heads_and_experts():
    cfg = tiny_config("tiny")  # 4 heads, 2 o_groups, 16 indexer heads, 4 experts
    cases = [
        (cfg, 3, r"--tp-size 3 does not divide the model's attention heads \(4\)"),
        (dataclasses.replace(cfg, num_heads=8), 4, r"output groups \(o_groups\) \(2\)"),
        (dataclasses.replace(cfg, num_heads=8, o_groups=8, index_n_heads=12), 8, r"indexer heads \(12\)"),
        (dataclasses.replace(cfg, num_heads=8, o_groups=4, n_routed_experts=6), 4, r"routed experts \(6\)"),
    ]
    for config, size, message in cases:
        with pytest.raises(ConfigError, match=message):
            ShardPlan(config, 0, size)
    assert ShardPlan(cfg, 1, 2).experts == range(2, 4)


def test_each_rank_loads_only_its_share(tiny_ckpt):
    cfg = ModelConfig.from_json(tiny_ckpt)
    whole = dsv4.weights.load_state_dict(tiny_ckpt, cfg)
    parts = [dsv4.weights.load_state_dict(tiny_ckpt, cfg, select=ShardPlan(cfg, r, 2).select) for r in range(2)]
    for name, tensor in whole.items():
        if ".experts." in name:
            held = [p[name] for p in parts if name in p]
            assert len(held) == 1 and torch.equal(held[0], tensor), name  # one rank, whole
        elif name.endswith(("attn.wo_b.weight", "shared_experts.w2.weight")):
            assert torch.equal(torch.cat([p[name] for p in parts], dim=1), tensor), name
        elif name.endswith(("attn.wq_b.weight", "attn_sink", "wo_a.weight", "indexer.wq_b.weight",
                            "weights_proj.weight", "shared_experts.w1.weight", "shared_experts.w3.weight")):
            assert torch.equal(torch.cat([p[name] for p in parts]), tensor), name
            assert parts[0][name].shape[0] * 2 == tensor.shape[0]
        else:
            assert all(torch.equal(p[name], tensor) for p in parts), name  # replicated
    held = [sum(t.nbytes for t in p.values()) for p in parts]
    assert held[0] == held[1] < sum(t.nbytes for t in whole.values())


def test_parallel_flags_and_their_refusals():
    from dsv4.__main__ import build_parser
    from dsv4.config import RankDelay, ServerArgs

    args = ServerArgs.from_cli(build_parser().parse_args(
        ["serve", "--tp-size", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000",
         "--fault-inject", "delay:rank1:forward:0.2:300ms"]))
    assert (args.tp_size, args.nnodes, args.node_rank, args.dist_init_addr) == (4, 2, 1, "10.0.0.1:5000")
    assert args.faults.rank_delays == (RankDelay(1, "forward", 0.2, 0.3),)
    for bad, message in (({"tp_size": 0}, "--tp-size 0"), ({"tp_size": 3, "nnodes": 2}, "--nnodes 2"),
                         ({"tp_size": 2, "nnodes": 2}, "--dist-init-addr"),
                         ({"tp_size": 2, "node_rank": 1}, "--node-rank 1"),
                         ({"tp_size": 2, "verify_indexer": "count"}, "--verify-indexer"),
                         ({"fault_inject": "delay:rank1:sample:0.5:1s"}, "unknown phase 'sample'")):
        with pytest.raises(ConfigError, match=message):
            ServerArgs(**bad)
