"""CPU tests of ``bench verify --gemms``: the layers' per-rank GEMM shapes, the options, and the
adapter that runs them before each collective (on CPU tensors, with a fake backend)."""

from __future__ import annotations

import types

import pytest
import torch

from bench import __main__ as bench_cli
from bench import layer_gemms, verify_options
from bench.layer_gemms import Gemm, GemmAdapter


def test_deepseek_v3_shapes_at_tp8() -> None:
    attention, mlp = layer_gemms.layer_of("kimi-k2.5").stages(8)
    assert attention == (Gemm("q_b_proj", 1536, 3072), Gemm("kv_b_proj", 512, 4096), Gemm("o_proj", 2048, 7168))
    assert mlp == (Gemm("gate_up_proj", 7168, 512, 9), Gemm("down_proj", 256, 7168, 9))
    assert layer_gemms.layer_of("deepseek-v3/kimi-k2.5") is layer_gemms.layer_of("kimi-k2.5")
    assert layer_gemms.layer_of("custom-L2-H256") is None


@pytest.mark.parametrize("model", sorted(layer_gemms.LAYERS))
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_every_preset_shards_its_gemms_over_the_ranks(model: str, world: int) -> None:
    layer = layer_gemms.layer_of(model)
    hidden = verify_options.PRESETS[model][1]
    assert layer.hidden == hidden  # the GEMMs end where the collective's [T, H] begins
    attention, mlp = layer.stages(world)
    one_rank = layer.stages(1)
    assert attention[-1].n == mlp[-1].n == hidden  # row-parallel outputs: the all-reduce's input
    for sharded, whole in zip(attention + mlp, one_rank[0] + one_rank[1]):
        slack = 2 * world * whole.batch * (whole.k + whole.n) * 2  # one row or column more per rank, rounding up
        assert whole.weight_bytes(2) <= sharded.weight_bytes(2) * world <= whole.weight_bytes(2) + slack
    text = layer_gemms.describe(model, world, 4)
    assert text.startswith(f"{model} at TP {world}, T = 4:") and "MiB of weights" in text


def test_gemms_option_and_its_compute_default() -> None:
    parser = bench_cli.build_parser()

    def cfg(*argv: str):
        args = parser.parse_args(["verify", *argv])
        return verify_options.config_from_args(args, args.parser, 1)

    assert not cfg().gemms and cfg().compute_ms == 5.0
    with_gemms = cfg("--gemms", "--model", "kimi-k2.5")
    assert with_gemms.gemms and with_gemms.compute_ms == 0.0  # the pass holds the compute now
    assert cfg("--gemms", "--compute-ms", "2").compute_ms == 2.0
    with pytest.raises(SystemExit):
        cfg("--gemms", "--layers", "2", "--hidden", "256")


class _Recorder:
    """A fake backend: records, per call, which outputs the GEMMs had written by then."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.checked = False

    def buffers(self, count: int, dtype: torch.dtype, algo: str, **shape):
        assert "model" not in shape
        return types.SimpleNamespace(count=count, hidden=shape.get("hidden"))

    def resolved_algo(self, size_bytes: int, dtype: torch.dtype, algo: str, **shape) -> str:
        assert "model" not in shape
        return algo

    def call(self, bufs, algo: str) -> str:
        self.calls.append(algo)
        return algo

    def check(self) -> None:
        self.checked = True


def test_the_adapter_runs_attention_then_mlp_before_alternate_collectives(monkeypatch) -> None:
    small = layer_gemms.LayerShape(64, (("qkv_proj", 64, 96),), 32, 48, experts=2)
    monkeypatch.setattr(layer_gemms, "LAYERS", {**layer_gemms.LAYERS, "tiny": small})
    inner = _Recorder()
    ctx = types.SimpleNamespace(device=torch.device("cpu"), world_size=2)
    adapter = GemmAdapter(inner, ctx, types.SimpleNamespace(seed=3))
    assert adapter.resolved_algo(512, torch.float32, "auto", hidden=64, model="tiny") == "auto"
    bufs = adapter.buffers(3 * 64, torch.float32, "auto", hidden=64, model="tiny")
    assert bufs.hidden == 64 and bufs.count == 192
    stages = adapter._stages[("tiny", 3, torch.float32)]
    assert len(stages) == 2
    outs = []
    for stage in stages:  # what each stage's work writes: its closure's (a, weight sets, out)
        work = stage.__defaults__[0]
        outs.append(work)
    attention, mlp = small.stages(2)
    assert [tuple(o.shape) for _, _, o in outs[0]] == [(1, 3, 48), (1, 3, 64)]  # qkv 96 / 2, o_proj -> hidden
    assert [tuple(o.shape) for _, _, o in outs[1]] == [(2, 3, 48), (2, 3, 64)]  # 2 experts: 2 x 24, down
    for i in range(4):  # layers 0 and 1: attention, MLP, attention, MLP
        for work in outs:
            for _, _, o in work:
                o.fill_(float("nan"))
        assert adapter.call(bufs, "auto") == "auto"
        stage = outs[i % 2]
        layer = i // 2
        for a, sets, o in stage:
            assert torch.equal(o, torch.bmm(a, sets[layer % layer_gemms.WEIGHT_SETS])), (i, layer)
        other = outs[1 - i % 2]
        assert all(torch.isnan(o).all() for _, _, o in other), i  # the other stage did not run
    assert inner.calls == ["auto"] * 4
    adapter.check()
    assert inner.checked  # everything else is the wrapped backend's
    # a second T of the same model shares the weights, with activations of its own
    adapter.buffers(5 * 64, torch.float32, "auto", hidden=64, model="tiny")
    assert adapter._stages[("tiny", 5, torch.float32)][0].__defaults__[0][0][1] is outs[0][0][1]
    # a model without known shapes: the collectives alone
    adapter.buffers(64, torch.float32, "auto", hidden=64, model="custom-L2-H64")
    adapter.call(bufs, "x")
    assert inner.calls[-1] == "x"
