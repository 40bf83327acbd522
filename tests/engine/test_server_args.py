import argparse

import pytest

from dsv4.config import ConfigError, FaultInjection, ServerArgs


def parse(*argv):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli(parser.parse_args(argv))


def test_defaults_and_sglang_flag_names():
    assert parse() == ServerArgs()
    args = parse("--model", "/m", "--port", "8000", "--dtype", "float64", "--page-size", "256",
                 "--chunked-prefill-size", "97", "--index-key-dtype", "fp32", "--kv-cache-dtype", "fp8_e4m3",
                 "--max-running-requests", "8", "--tick-stall-timeout", "2.5")
    assert (args.model, args.port, args.dtype, args.page_size) == ("/m", 8000, "float64", 256)
    assert (args.chunked_prefill_size, args.index_key_dtype, args.kv_cache_dtype) == (97, "fp32", "fp8_e4m3")
    assert args.tick_stall_timeout == 2.5 and args.faults == FaultInjection()


def test_fault_injection_spec():
    assert parse("--fault-inject", "stall_tick=1.5@7,crash_tick=9").faults == FaultInjection(1.5, 7, 9)
    with pytest.raises(ConfigError, match="stall_tick=SECONDS@TICK"):
        ServerArgs(fault_inject="stall_tick=soon")


@pytest.mark.parametrize("bad", [{"page_size": 100}, {"max_total_tokens": 64}, {"chunked_prefill_size": 8},
                                 {"dtype": "float16"}, {"tick_stall_timeout": 0}, {"cpu_threads": -1}])
def test_invalid_arguments_are_named(bad):
    with pytest.raises(ConfigError, match=next(iter(bad)).replace("_", "-")):
        ServerArgs(**bad)


def test_dtype_auto_picks_the_faster_of_bf16_and_fp32(monkeypatch):
    from dsv4.config import server_args

    for fast_bf16, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(server_args, "cpu_has_fast_bf16", lambda fast=fast_bf16: fast)
        assert ServerArgs(device="cpu").dtype == expected
        assert parse("--device", "cpu", "--dtype", "auto").dtype == expected
        assert ServerArgs(device="cpu", dtype="bfloat16").dtype == "bfloat16"  # an explicit dtype is kept
    assert server_args.auto_dtype("cuda") == "bfloat16"
