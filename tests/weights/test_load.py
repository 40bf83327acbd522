"""load_state_dict on tiny checkpoints: decoded values, layouts, namings, and failures that name the tensor."""

import json
import logging
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv4.config import ConfigError, ModelConfig
from dsv4.tiny import random_state_dict, tiny_config, tiny_state_dict
from dsv4.weights import (
    INDEX_FILE,
    WeightError,
    hf_to_official,
    load_state_dict,
    official_name,
    save_checkpoint,
    storage_roundtrip,
)


@pytest.fixture(scope="module")
def truth_bf16():
    return tiny_state_dict("tiny", "bf16")[1]


@pytest.fixture(scope="module")
def truth_fp8():
    return tiny_state_dict("tiny", "fp8")[1]


@pytest.fixture(scope="module")
def tiny_random():
    cfg = tiny_config()
    return cfg, random_state_dict(cfg)


def _load(path, **kwargs):
    return load_state_dict(path, ModelConfig.from_json(path), **kwargs)


def _assert_same(loaded, truth):
    assert loaded.keys() == truth.keys()
    for name, tensor in truth.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def _rewrite(src, dst, edit):
    """Copy checkpoint `src` to `dst`, letting `edit(tensors)` change its single safetensors file."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def _load_error(path) -> str:
    with pytest.raises(WeightError) as info:
        _load(path)
    return str(info.value)


# -- what loads ------------------------------------------------------------------------------------


def test_bf16_checkpoint_loads_its_decoded_values(tiny_ckpt, truth_bf16):
    _assert_same(_load(tiny_ckpt), truth_bf16)


def test_fp8_checkpoint_loads_its_decoded_values(tiny_ckpt_fp8, truth_fp8):
    _assert_same(_load(tiny_ckpt_fp8), truth_fp8)


def test_fp8_values_are_close_to_bf16_ones(truth_bf16, truth_fp8):
    for name in ("layers.1.attn.wq_b.weight", "layers.2.ffn.shared_experts.w2.weight"):
        assert torch.allclose(truth_fp8[name], truth_bf16[name], rtol=0.07, atol=0.02), name
    expert = "layers.3.ffn.experts.1.w3.weight"
    assert (truth_fp8[expert] - truth_bf16[expert]).norm() < 0.2 * truth_bf16[expert].norm()


def test_requested_dtype_and_integer_tid2eid(tiny_ckpt, truth_bf16):
    loaded = _load(tiny_ckpt, dtype=torch.float64)
    assert loaded["layers.0.attn.wq_a.weight"].dtype == torch.float64
    assert torch.equal(loaded["layers.0.attn.wq_a.weight"], truth_bf16["layers.0.attn.wq_a.weight"].double())
    assert loaded["layers.0.ffn.gate.tid2eid"].dtype == torch.int64


def test_fp8_checkpoint_uses_the_official_storage_formats(tiny_ckpt_fp8):
    with safe_open(tiny_ckpt_fp8 / "model.safetensors", "pt") as f:
        stored = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()}  # noqa: SIM118
    cfg = ModelConfig.from_json(tiny_ckpt_fp8)
    d, heads_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    assert stored["layers.1.attn.wq_b.weight"] == ("F8_E4M3", (heads_dim, cfg.q_lora_rank))
    assert stored["layers.1.attn.wq_b.scale"] == ("F8_E8M0", (heads_dim // 128, 1))
    for name in ("attn.wq_a", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b", "ffn.shared_experts.w2"):
        assert stored[f"layers.1.{name}.weight"][0] == "F8_E4M3", name
    inter = cfg.moe_intermediate_size
    assert stored["layers.1.ffn.experts.0.w1.weight"] == ("I8", (inter, d // 2))
    assert stored["layers.1.ffn.experts.0.w1.scale"] == ("F8_E8M0", (inter, d // 32))
    assert stored["layers.1.ffn.experts.0.w2.weight"] == ("I8", (d, inter // 2))
    for name in ("embed.weight", "head.weight", "norm.weight", "layers.1.ffn.gate.weight",
                 "layers.1.attn.compressor.wkv.weight", "layers.1.attn.indexer.weights_proj.weight"):
        assert stored[name][0] == "BF16", name
    for name in ("hc_head_fn", "layers.1.hc_attn_base", "layers.1.attn.attn_sink", "layers.1.attn.compressor.ape",
                 "layers.1.ffn.gate.bias"):
        assert stored[name][0] == "F32", name
    assert stored["layers.0.ffn.gate.tid2eid"][0] == "I64"
    config = json.loads((tiny_ckpt_fp8 / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"


def test_sharded_checkpoint_with_index_loads_the_same(tmp_path, tiny_random, truth_fp8):
    cfg, state_dict = tiny_random
    shards = save_checkpoint(tmp_path, cfg, state_dict, fmt="fp8", max_shard_bytes=300_000)
    assert len(shards) > 3 and not (tmp_path / "model.safetensors").exists()
    weight_map = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    assert weight_map["layers.1.attn.wq_b.scale"] == weight_map["layers.1.attn.wq_b.weight"]
    reports = []
    loaded = load_state_dict(tmp_path, cfg, progress=lambda done, total: reports.append((done, total)))
    _assert_same(loaded, truth_fp8)
    assert len(reports) == len(shards)
    assert [done for done, _ in reports] == sorted(done for done, _ in reports)
    assert reports[-1][0] == reports[-1][1]


def test_large_checkpoints_log_one_line_per_shard(tmp_path, tiny_random, monkeypatch, caplog):
    cfg, state_dict = tiny_random
    shards = save_checkpoint(tmp_path, cfg, state_dict, max_shard_bytes=1_000_000)
    monkeypatch.setattr("dsv4.weights.load.PROGRESS_LOG_BYTES", 0)
    with caplog.at_level(logging.INFO, logger="dsv4.weights"):
        load_state_dict(tmp_path, cfg)
    lines = [r.getMessage() for r in caplog.records if "GB/s" in r.getMessage()]
    assert len(lines) == len(shards) and shards[0].name in lines[0]


def test_weight_and_scale_in_different_shards_load(tmp_path, tiny_random, truth_fp8):
    cfg, state_dict = tiny_random
    save_checkpoint(tmp_path, cfg, state_dict, fmt="fp8", max_shard_bytes=300_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shard = index["weight_map"]["layers.1.attn.wq_b.scale"]
    tensors = load_file(tmp_path / shard)
    save_file({"layers.1.attn.wq_b.scale": tensors.pop("layers.1.attn.wq_b.scale")}, tmp_path / "scale-only.safetensors")
    save_file(tensors, tmp_path / shard)
    index["weight_map"]["layers.1.attn.wq_b.scale"] = "scale-only.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    _assert_same(load_state_dict(tmp_path, cfg), truth_fp8)


def test_hf_named_checkpoint_loads_the_same_as_official(tiny_ckpt, tmp_path, truth_bf16):
    """transformers reads our official names with its own mapping; its names must map back."""
    transformers = pytest.importorskip("transformers")
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    hf_state = {name: t.contiguous() for name, t in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf_state  # merged experts, HF style
    _assert_same(hf_to_official(hf_state), truth_bf16)
    shutil.copy(tiny_ckpt / "config.json", tmp_path / "config.json")
    save_file(hf_state, tmp_path / "model.safetensors")
    _assert_same(_load(tmp_path), truth_bf16)


def test_hf_style_fp8_names_with_weight_scale_inv_load(tiny_ckpt_fp8, tmp_path, truth_fp8):
    def rename(tensors):
        tensors["model.layers.0.self_attn.q_a_proj.weight"] = tensors.pop("layers.0.attn.wq_a.weight")
        tensors["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] = tensors.pop("layers.0.attn.wq_a.scale")
        tensors["model.layers.0.attn_hc.scale"] = tensors.pop("layers.0.hc_attn_scale")

    _assert_same(_load(_rewrite(tiny_ckpt_fp8, tmp_path / "ckpt", rename)), truth_fp8)


def test_official_names_of_hf_names():
    assert official_name("model.embed_tokens.weight") == "embed.weight"
    assert official_name("lm_head.weight") == "head.weight"
    assert official_name("model.hc_head.hc_scale") == "hc_head_scale"
    assert official_name("model.layers.3.mlp.gate.e_score_correction_bias") == "layers.3.ffn.gate.bias"
    assert official_name("model.layers.1.self_attn.compressor.indexer.kv_norm.weight") == (
        "layers.1.attn.indexer.compressor.norm.weight"
    )
    assert official_name("model.layers.1.mlp.experts.5.down_proj.weight") == "layers.1.ffn.experts.5.w2.weight"
    assert official_name("layers.1.attn.wq_b.scale") == "layers.1.attn.wq_b.scale"


def test_mtp_tensors_are_skipped(tiny_ckpt, tmp_path, truth_bf16):
    def add_mtp(tensors):
        tensors["mtp.0.e_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)

    _assert_same(_load(_rewrite(tiny_ckpt, tmp_path / "ckpt", add_mtp)), truth_bf16)


def test_storage_roundtrip_matches_the_files(tiny_ckpt_fp8, tiny_random, truth_fp8):
    cfg, state_dict = tiny_random
    assert cfg == ModelConfig.from_json(tiny_ckpt_fp8)
    _assert_same(storage_roundtrip(state_dict, "fp8"), truth_fp8)


# -- what fails, and how it says so ----------------------------------------------------------------


def test_missing_tensor_is_named_with_its_expected_shape(tiny_ckpt, tmp_path):
    path = _rewrite(tiny_ckpt, tmp_path / "ckpt", lambda t: t.pop("layers.2.attn.compressor.ape"))
    message = _load_error(path)
    assert "missing tensor 'layers.2.attn.compressor.ape'" in message and "(128, 512)" in message
    assert str(path) in message


def test_wrong_shape_is_named(tiny_ckpt, tmp_path):
    def shrink(tensors):
        tensors["layers.1.attn.wq_a.weight"] = tensors["layers.1.attn.wq_a.weight"][:, :32].contiguous()

    message = _load_error(_rewrite(tiny_ckpt, tmp_path / "ckpt", shrink))
    assert "'layers.1.attn.wq_a.weight'" in message and "(64, 32)" in message and "expected (64, 64)" in message


def test_norm_stored_as_int8_is_a_dtype_error(tiny_ckpt, tmp_path):
    def to_int8(tensors):
        tensors["layers.0.attn_norm.weight"] = tensors["layers.0.attn_norm.weight"].to(torch.int8)

    message = _load_error(_rewrite(tiny_ckpt, tmp_path / "ckpt", to_int8))
    assert "'layers.0.attn_norm.weight'" in message and "I8" in message and "floating-point" in message


def test_fp8_weight_without_scale_is_named(tiny_ckpt_fp8, tmp_path):
    message = _load_error(_rewrite(tiny_ckpt_fp8, tmp_path / "ckpt", lambda t: t.pop("layers.0.attn.wkv.scale")))
    assert "'layers.0.attn.wkv.weight'" in message and "without its scale" in message
    assert "'layers.0.attn.wkv.scale'" in message


def test_scale_of_wrong_shape_is_named(tiny_ckpt_fp8, tmp_path):
    def widen(tensors):
        scale = tensors["layers.1.ffn.experts.2.w1.scale"].view(torch.uint8)  # uint8 exponents are accepted too
        tensors["layers.1.ffn.experts.2.w1.scale"] = torch.cat([scale, scale], 1)

    message = _load_error(_rewrite(tiny_ckpt_fp8, tmp_path / "ckpt", widen))
    assert "'layers.1.ffn.experts.2.w1.scale'" in message and "(32, 4)" in message
    assert "expected (32, 2)" in message and "1x32" in message


def test_packed_fp4_of_wrong_shape_reports_the_decoded_shape(tiny_ckpt_fp8, tmp_path):
    def widen(tensors):
        tensors["layers.1.ffn.experts.0.w2.weight"] = torch.cat([tensors["layers.1.ffn.experts.0.w2.weight"]] * 2, 1)

    message = _load_error(_rewrite(tiny_ckpt_fp8, tmp_path / "ckpt", widen))
    assert "'layers.1.ffn.experts.0.w2.weight'" in message
    assert "decodes to (64, 64)" in message and "expected (64, 32)" in message


def test_scale_on_a_bf16_weight_is_an_error(tiny_ckpt, tmp_path):
    def add_scale(tensors):
        tensors["layers.0.attn.wq_a.scale"] = torch.ones(1, 1)

    message = _load_error(_rewrite(tiny_ckpt, tmp_path / "ckpt", add_scale))
    assert "'layers.0.attn.wq_a.weight'" in message and "only FP8/FP4 weights have scales" in message


def test_nan_scale_is_an_error(tiny_ckpt_fp8, tmp_path):
    def poison(tensors):
        tensors["layers.2.attn.wo_b.scale"] = torch.full_like(tensors["layers.2.attn.wo_b.scale"].view(torch.uint8), 255)

    message = _load_error(_rewrite(tiny_ckpt_fp8, tmp_path / "ckpt", poison))
    assert "'layers.2.attn.wo_b.weight'" in message and "NaN" in message


def test_tid2eid_out_of_range_is_named(tiny_ckpt, tmp_path):
    def corrupt(tensors):
        tensors["layers.0.ffn.gate.tid2eid"][17, 1] = 4

    message = _load_error(_rewrite(tiny_ckpt, tmp_path / "ckpt", corrupt))
    assert "'layers.0.ffn.gate.tid2eid'" in message and "expert id 4 for token 17" in message and "0..3" in message


def test_tid2eid_int32_loads_and_float_fails(tiny_ckpt, tmp_path, truth_bf16):
    def to_dtype(dtype):
        def edit(tensors):
            tensors["layers.0.ffn.gate.tid2eid"] = tensors["layers.0.ffn.gate.tid2eid"].to(dtype)

        return edit

    _assert_same(_load(_rewrite(tiny_ckpt, tmp_path / "int32", to_dtype(torch.int32))), truth_bf16)
    message = _load_error(_rewrite(tiny_ckpt, tmp_path / "float", to_dtype(torch.float32)))
    assert "'layers.0.ffn.gate.tid2eid'" in message and "integer" in message


def test_unexpected_tensor_is_an_error(tiny_ckpt, tmp_path):
    def extra_layer(tensors):
        tensors["layers.4.attn.wq_a.weight"] = tensors["layers.0.attn.wq_a.weight"].clone()

    message = _load_error(_rewrite(tiny_ckpt, tmp_path / "ckpt", extra_layer))
    assert "unexpected tensor 'layers.4.attn.wq_a.weight'" in message and "4 layers" in message


def test_tensor_given_under_both_namings_is_an_error(tiny_ckpt, tmp_path):
    def duplicate(tensors):
        tensors["model.embed_tokens.weight"] = tensors["embed.weight"].clone()

    assert "'embed.weight'" in _load_error(_rewrite(tiny_ckpt, tmp_path / "ckpt", duplicate))


def test_config_with_more_experts_than_the_checkpoint_fails(tiny_ckpt, tmp_path):
    shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["n_routed_experts"] = 5
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    message = _load_error(tmp_path / "ckpt")
    assert "missing tensor 'layers.0.ffn.experts.4.w1.weight'" in message
    assert "'layers.0.ffn.gate.weight': stored shape (4, 64), expected (5, 64)" in message


def test_unknown_compress_ratio_in_config_fails(tiny_ckpt, tmp_path):
    shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["compress_ratios"][1] = 8
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="layer 1: unknown compress ratio 8"):
        ModelConfig.from_json(tmp_path / "ckpt")


def test_truncated_safetensors_file_is_named(tiny_ckpt, tmp_path):
    shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    message = _load_error(tmp_path / "ckpt")
    assert "model.safetensors" in message and "not a readable safetensors file" in message


def test_garbage_safetensors_file_is_named(tiny_ckpt, tmp_path):
    shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert "model.safetensors" in _load_error(tmp_path / "ckpt")


def test_index_naming_a_missing_shard_is_named(tmp_path, tiny_random):
    cfg, state_dict = tiny_random
    shards = save_checkpoint(tmp_path, cfg, state_dict, max_shard_bytes=1_000_000)
    shards[1].unlink()
    message = str(pytest.raises(WeightError, load_state_dict, tmp_path, cfg).value)
    assert shards[1].name in message and "does not exist" in message


def test_directory_without_weights_is_named(tmp_path):
    message = str(pytest.raises(WeightError, load_state_dict, tmp_path, tiny_config()).value)
    assert str(tmp_path) in message and "safetensors" in message
