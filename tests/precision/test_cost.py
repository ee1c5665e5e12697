import torch

from automp.precision import cost

GPU = cost.SPECS["h100"]  # its figures are the ones the arithmetic below uses


def test_embedding_seed_case_huge_table_stays_fp32():
    # V x D table, N looked-up rows: casting the table (V*D*6 bytes) dwarfs what the lookup saves.
    v, d, n = 1_000_000, 64, 512
    verdict = cost.gather_verdict(v * d, n * d, torch.bfloat16, GPU)
    assert not verdict.low and "table" in verdict.reason


def test_embedding_small_table_many_lookups_converts():
    verdict = cost.gather_verdict(100 * 64, 100_000 * 64, torch.float16, GPU)
    assert verdict.low


def test_crossover_is_where_table_traffic_equals_saving():
    d = 64
    n = 10_000
    assert cost.gather_verdict(n * d, n * d, torch.bfloat16, GPU).low  # V = N: converting pays
    assert not cost.gather_verdict(4 * n * d, n * d, torch.bfloat16, GPU).low  # V = 4N: it does not


def test_device_spec_rates_and_cast_cost():
    assert GPU.rate(torch.bfloat16) > 10 * GPU.rate(torch.float32)
    # 1M elements fp32 -> bf16: 6 MB through a 3350 GB/s memory
    assert abs(cost.cast_seconds(10**6, torch.float32, torch.bfloat16, GPU) - 6e6 / 3350e9) < 1e-12
    assert cost.spec_for("cpu") is cost.CPU


def test_a_cast_inside_its_producers_kernel_costs_only_the_low_precision_write():
    n = 10**6
    fused = cost.input_cast_seconds(n, torch.bfloat16, GPU, fused=True)
    assert abs(fused - 2e6 / 3350e9) < 1e-12
    assert cost.input_cast_seconds(n, torch.bfloat16, GPU, fused=False) == cost.cast_seconds(
        n, torch.float32, torch.bfloat16, GPU) == 3 * fused


def test_spec_for_a_gpu_by_its_name_and_spec_named_by_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gpu, key in (("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H100 80GB HBM3", "h100")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_, name=gpu: name)
        assert cost.spec_for("cuda:0") is cost.SPECS[key] is cost.spec_named(key.upper())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA L4")
    assert cost.spec_for("cuda:0") is cost.DEFAULT_GPU is cost.SPECS["h100"]  # unknown GPU: the default's figures
    assert sorted(cost.SPECS) == ["a100", "cpu", "h100", "h200"]
