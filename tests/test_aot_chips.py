"""Slice names, chip figures, the compiler's out-of-memory message, compiler options, the roofline
recount and tpu_plan's flag checks (no libtpu needed)."""
import re

import pytest

from specjax.aot import chips
from specjax.aot.compile import parse_oom
from specjax.compiler_options import parse_compiler_options


@pytest.mark.parametrize("name,topology,n", [
    ("v5e-8", "v5e:2x4", 8), ("v5e-256", "v5e:16x16", 256), ("v6e-16", "v6e:4x4", 16),
    # v5p / v4 slice names count TensorCores, two per chip
    ("v5p-64", "v5p:2x4x4", 32), ("v5p-128", "v5p:4x4x4", 64), ("v5p:4x4x4", "v5p:4x4x4", 64),
])
def test_slice_names(name, topology, n):
    assert chips.topology_name(name) == topology
    assert chips.num_chips(name) == n


def test_bad_slice_names_are_refused():
    with pytest.raises(ValueError, match="unknown TPU"):
        chips.topology_name("v9-8")
    with pytest.raises(ValueError, match="no standard topology"):
        chips.topology_name("v5e-12")


def test_chip_table_orders():
    c = chips.CHIPS
    assert c["v5e"].hbm_bytes == 16 * chips.GIB and c["v5p"].hbm_bytes == 95 * chips.GIB
    # ridge points (FLOP per byte at which a chip turns compute-bound) of the public figures
    ridge = {k: v.peak_bf16_flops / v.hbm_bandwidth for k, v in c.items()}
    assert 150 < ridge["v5p"] < ridge["v5e"] < ridge["v6e"]


def test_parse_oom_messages():
    assert parse_oom("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
                     "for HLO temporaries (23.33G) exceeds available HBM (15.75G).") == (
        int(23.33 * 2**30), int(15.75 * 2**30))
    assert parse_oom("... Used 111.6G of 15.75G hbm. Exceeded hbm capacity by 95.8G.") == (
        int(111.6 * 2**30), int(15.75 * 2**30))
    assert parse_oom("INTERNAL: something else") is None


def test_fsdp_tile_warning_names_partial_bf16_tiles_per_chip():
    from specjax.aot.chips import BF16_TILE_ROWS, fsdp_tile_warning
    assert BF16_TILE_ROWS == 16
    for hidden, fsdp in [(2560, 32), (4096, 256), (1024, 64), (2560, 1), (64, 4)]:
        assert fsdp_tile_warning(hidden, fsdp) is None, (hidden, fsdp)
    w = fsdp_tile_warning(2560, 256)
    assert w.startswith("FSDP over 256 chips leaves 10 of the 2560 hidden rows per chip")
    assert fsdp_tile_warning(2560, 64) is not None  # 40 rows: 2.5 tiles
    assert fsdp_tile_warning(100, 3) is None  # uneven shards: no per-chip share to reason about


def test_parse_compiler_options_types_values_and_refuses_bare_names():
    got = parse_compiler_options(["xla_a=false", "--xla_b=12", "xla_c=0.5", "xla_d=abc",
                                  "xla_e=TRUE", " xla_f = 3 "])
    assert got == {"xla_a": False, "xla_b": 12, "xla_c": 0.5, "xla_d": "abc", "xla_e": True,
                   "xla_f": 3}
    assert type(got["xla_b"]) is int and type(got["xla_a"]) is bool
    assert parse_compiler_options([]) == {} == parse_compiler_options("")
    # one comma-separated string, as config.train.tpu_compiler_options holds it
    assert parse_compiler_options("xla_a=false, xla_b=2,") == {"xla_a": False, "xla_b": 2}
    for bad in ("xla_a", "=1"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            parse_compiler_options([bad])


def test_recount_model_flops_derives_the_roofline_again_by_hand():
    """``recount_model_flops`` replaces a report's model FLOPs and derives roofline, bound and
    MFU again from its compiled numbers: on v5e (197 TFLOP/s, 819 GB/s per chip) 1.97e12 FLOPs
    are 10 ms and 1.638e10 bytes 20 ms; model FLOPs of 5.91e12 make the step compute-bound at
    30 ms with an MFU of 1 (set by them), 0.985e12 leave it memory-bound at 20 ms with an MFU of
    1/4."""
    from specjax.aot.compile import ProgramReport, recount_model_flops
    row = ProgramReport(name="step", topology="v5e:2x4", chip="v5e", num_devices=8, mesh={},
                        shapes={},
                        compiled=True, flops=1.97e12, bytes_accessed=1.638e10,
                        hbm_bytes=chips.CHIPS["v5e"].hbm_bytes, model_flops=1.0e12,
                        notes={"x": 1}).to_dict()
    up = recount_model_flops(row, 5.91e12)
    assert up["bound"] == "compute" and up["roofline_seconds"] == pytest.approx(0.03)
    assert up["mfu"] == pytest.approx(1.0) and up["model_flops"] == 5.91e12
    assert up["notes"] == {"x": 1, "model_flops_compiled_with": 1.0e12} and row["notes"] == {"x": 1}
    down = recount_model_flops(up, 0.985e12)  # keeps the value it was compiled with
    assert down["bound"] == "memory" and down["roofline_seconds"] == pytest.approx(0.02)
    assert down["mfu"] == pytest.approx(0.25)
    assert down["notes"]["model_flops_compiled_with"] == 1.0e12
    with pytest.raises(ValueError, match="only a compiled report"):
        recount_model_flops({**row, "compiled": False}, 1e12)


@pytest.mark.parametrize("args, message", [
    (["--recount_model_flops"], "works on --table's output"),
    (["--table", "--recount_model_flops", "--out", "{tmp}"], "no table.json in --out"),
    (["--config", "experiments/configs/train_drafter.py:mtp_e2e_tv,tiny", "--topology", "v9-8"],
     "--topology: unknown TPU slice 'v9-8'"),
    (["--config", "experiments/configs/train_drafter.py:mtp_e2e_tv,tiny", "--topology", "v5e:2x2",
      "--engine_max_len", "256", "--engine_flops_context", "512"],
     "--engine_flops_context must be in 0..--engine_max_len (256), got 512"),
])
def test_tpu_plan_refuses_bad_flags_with_a_usage_message(tmp_path, args, message):
    """``python -m experiments.tpu_plan`` stops on these with absl's usage message and exit 1,
    before any compilation (no libtpu needed), not with a traceback."""
    from _tiny_runs import hermetic_env, run_module
    proc = run_module(hermetic_env(tmp_path), "experiments.tpu_plan",
                      *[a.format(tmp=tmp_path) for a in args], timeout=120, check=False)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr


def test_peak_flops_of_tpu_devices_and_none_elsewhere():
    """The training loop's MFU denominator: the chip table's peak per device, summed, for devices
    whose ``device_kind`` is a listed TPU or GPU; ``None`` (no MFU logged) if any device is not."""
    from types import SimpleNamespace

    from specjax.training.train_loop import peak_flops
    v5e = SimpleNamespace(device_kind="TPU v5 lite")
    assert chips.chip_of_device_kind("TPU v5 lite").name == "v5e"
    assert chips.chip_of_device_kind("cpu") is None
    assert peak_flops([v5e] * 8) == 8 * 197e12
    assert peak_flops([v5e, SimpleNamespace(device_kind="cpu")]) is None
    assert peak_flops([]) is None
    # GPUs by their exact CUDA names: the SXM H100 and the PCIe card have different peaks, and a
    # name that is not listed gets no MFU rather than a neighbour's peak
    h100 = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
    assert peak_flops([h100] * 8) == 8 * 989e12
    assert chips.chip_of_device_kind("NVIDIA H100 PCIe").peak_bf16_flops == 756e12
    assert chips.chip_of_device_kind("NVIDIA H100") is None
    assert peak_flops([h100, SimpleNamespace(device_kind="NVIDIA H100 PCIe")]) == 989e12 + 756e12


def test_gpu_table_in_the_docstring_is_the_gpu_dict():
    """The module docstring's GPU table (what users read) holds the figures :data:`GPUS` uses, row
    for row, and no GPU name is also a TPU's ``device_kind``."""
    rows = [line for line in chips.__doc__.splitlines() if line.startswith("NVIDIA")]
    assert len(rows) == len(chips.GPUS)
    for line in rows:  # columns: device_kind, peak TFLOP/s, "N GB/s [(note)]", GiB [(note)]
        kind, peak, bandwidth, memory = re.split(r"\s{2,}", line)
        spec = chips.GPUS[kind]
        assert spec.device_kind == kind
        assert float(peak) * 1e12 == spec.peak_bf16_flops
        assert float(bandwidth.split()[0].replace(",", "")) * 1e9 == spec.hbm_bandwidth
        assert int(memory.split()[0]) * chips.GIB == spec.hbm_bytes
    assert not set(chips.GPUS) & {c.device_kind for c in chips.CHIPS.values()}
