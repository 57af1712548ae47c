"""Ahead-of-time compilation for a real TPU topology ("v5e:2x2", 4 chips) on the CPU.

Every program specjax runs on a TPU must pass the TPU compiler: the train step, the drafter train
steps (MTP + e2e-TV, DSpark), the engine's device steps and the Pallas rejection sampler. A config
too large for the chip must come back as "does not fit" with the compiler's numbers.

Needs libtpu (``make test`` installs it into ``.venv/libtpu``); without it these tests skip.
"""
import os

import jax
import pytest

from specjax import aot

pytestmark = [
    pytest.mark.skipif(aot.libtpu_path() is None,
                       reason="libtpu not installed (`make libtpu` puts it in .venv/libtpu)"),
    pytest.mark.xdist_group("aot_tpu"),
]

TOPOLOGY = "v5e:2x2"


def _train_config(task="lm", **data):
    from specjax.training.config import default_config
    c = default_config(task)
    c.model.preset = "tiny"
    c.data.batch_size = data.get("batch_size", 8)
    c.data.seq_len = data.get("seq_len", 64)
    return c


def _compile(program, mesh):
    report = aot.compile_program(program, mesh, TOPOLOGY)
    assert report.compiled, report.error
    assert report.flops > 0 and report.bytes_accessed > 0
    assert 0 < report.used_bytes <= report.hbm_bytes
    assert report.roofline_seconds > 0
    # XLA's own estimate is kept only where it is one (libtpu reports negative times on v5e)
    assert report.compiler_seconds is None or report.compiler_seconds >= 0
    assert "peak_live" not in report.notes  # only with explain_memory=True
    return report


def test_topology_is_a_real_tpu():
    devices = aot.topology_devices(TOPOLOGY)
    assert len(devices) == 4
    assert devices[0].platform == "tpu" and devices[0].device_kind == "TPU v5 lite"


def test_lm_train_step_compiles_and_fits():
    c = _train_config()
    mesh = aot.topology_mesh(TOPOLOGY, c.mesh.to_dict())
    r = _compile(aot.train_step(c, mesh), mesh)
    assert r.fits and r.mesh == {"data": 1, "fsdp": 4, "tensor": 1}
    # the donated state is aliased to the new state
    assert r.alias_bytes > 0
    # the compiler's FLOPs include the model's (6 N per token) on this device's quarter of rows
    assert r.flops >= r.model_flops
    assert 0 < r.mfu <= 1


def test_train_step_warns_when_fsdp_leaves_partial_tiles_per_chip():
    """The pre-flight's hint (docs/TPU.md, "FSDP width"): 40 hidden rows over 4 chips leave 10
    per chip; 64 leave 16 (whole bf16 tiles: no note). Building the program compiles nothing."""
    c = _train_config()
    mesh = aot.topology_mesh(TOPOLOGY, c.mesh.to_dict())
    assert "warning" not in aot.train_step(c, mesh).notes
    c.model.overrides.hidden_size = 40
    warning = aot.train_step(c, mesh).notes["warning"]
    assert "FSDP over 4 chips leaves 10 of the 40 hidden rows per chip" in warning


def test_attention_chunk_lowers_the_compiled_drafter_step_peak():
    """``config.train.attention_chunk``: the trainer computes every attention of the loss in
    query chunks (docs/TPU.md, "Memory"). At one 512-token row per chip the dense step holds at
    least one whole f32 score tensor ``[1, heads, 512, 512]`` (4 MiB for the tiny model's 4
    heads); with 128-query chunks only a quarter of one is needed at a time, so the compiled
    peak must fall by at least 3/4 of it. The chunks recompute their scores in the backward
    pass, so the compiled FLOPs must not fall: they would if a loop over chunks hid all but one
    from XLA's cost analysis (it counts a loop body once)."""
    from experiments.configs.train_drafter import get_config
    from specjax.training.config import validate_config
    from specjax.training.lm_task import model_config_from
    used, flops = {}, {}
    for chunk in (0, 128):
        c = get_config("mtp_e2e_tv,tiny")
        c.data.batch_size, c.data.seq_len = 4, 512
        c.train.attention_chunk = chunk
        mesh = aot.topology_mesh(TOPOLOGY, c.mesh.to_dict())
        r = _compile(aot.train_step(c, mesh), mesh)
        used[chunk], flops[chunk] = r.used_bytes, r.flops
    heads = model_config_from(validate_config(c)).num_heads
    score = heads * 512 * 512 * 4  # bytes of one f32 [1, heads, 512, 512]
    assert used[0] - used[128] >= score * 3 / 4, used
    assert flops[128] >= flops[0], flops


def test_engine_device_steps_compile_tensor_parallel():
    from experiments.configs.train_drafter import get_config
    from specjax.models import get_preset
    task = get_config("dspark_markov,tiny").task
    mesh = aot.topology_mesh(TOPOLOGY, {"data": 1, "fsdp": 1, "tensor": -1})
    shapes = aot.EngineShapes(num_slots=4, max_len=128, gamma=3, buckets=(8, 16),
                              prefill_chunk=16)
    programs = aot.engine_steps(get_preset("tiny", num_kv_heads=4), task, mesh, shapes)
    names = [p.name for p in programs]
    assert names == ["engine.draft", "engine.verify[N=8]", "engine.verify[N=16]",
                     "engine.prefill[C=16]", "engine.loop[production, 16 steps]"]
    for p in programs:
        r = _compile(p, mesh)
        assert r.fits and r.mesh["tensor"] == 4


@pytest.mark.parametrize("variant", ["mtp_e2e_tv", "dspark_markov", "dspark_rnn", "dflash",
                                     "draft_lm"])
def test_engine_steps_compile_at_their_model_flops(variant):
    """The serving pre-flight's model FLOPs (``aot.engine_flops``: the target's forward over the
    tokens a step feeds, its LM head where logits are used, and each drafter's
    ``propose_flops`` / ``prefill_flops`` / ``commit_flops``) equal the matmuls of the compiled
    draft, verification and prefill steps, counted from their HLO.

    The shapes make the comparison exact: ``max_len`` 128 is a single attention window
    (``MIN_WINDOW``), so the compiled attention reads ``flops_context`` = 128 positions; the
    bucket of 16 tokens is every slot's γ + 1 (no padding of the ``[slots, γ+1]`` grid). Two
    things the HLO count does not see: the DSpark confidence head's matrix-vector product (run as
    a multiply and a reduce; under 0.1 % here), and the attention of a single query, which TPU
    also compiles without a dot: the draft LM's γ − 1 one-token steps and the MTP draft's last
    depth (one query per slot), taken off below."""
    from experiments.configs.train_drafter import get_config
    from specjax.models import get_preset
    from specjax.models.flops import attention_flops_per_query
    from specjax.training.drafter_build import build_drafter
    task = get_config(f"{variant},tiny").task
    target = get_preset("tiny", num_kv_heads=4)
    mesh = aot.topology_mesh(TOPOLOGY, {"data": 1, "fsdp": 1, "tensor": -1})
    slots, gamma, ctx = 4, 3, 128
    shapes = aot.EngineShapes(num_slots=slots, max_len=128, gamma=gamma, buckets=(16,),
                              prefill_chunk=16, loop_steps=0, flops_context=ctx)
    unseen = 0.0
    drafter = build_drafter(task, target)[0]
    if variant == "draft_lm":
        unseen = slots * (gamma - 1) * attention_flops_per_query(drafter.config, ctx)
    elif variant.startswith("mtp"):
        unseen = slots * attention_flops_per_query(drafter.config.block_config(target), ctx)
    for p in aot.engine_steps(target, task, mesh, shapes):
        if variant in ("dspark_rnn", "dflash") and p.name != "engine.draft":
            continue  # the same verification and prefill programs as DSpark-Markov's
        r = _compile(p, mesh)
        matmuls = r.notes["loops"]["matmul_flops"]
        expected = r.model_flops - (unseen / r.num_devices if p.name == "engine.draft" else 0)
        assert expected == pytest.approx(matmuls, rel=0.002), p.name


@pytest.mark.parametrize("batch,gamma,vocab", [(256, 8, 151936), (64, 8, 32000), (32, 4, 151936),
                                               (48, 4, 151936)])
def test_rejection_kernel_compiles_for_tpu_at_one_read_of_p_and_q(batch, gamma, vocab):
    mesh = aot.topology_mesh(TOPOLOGY, {"data": -1})
    r = _compile(aot.rejection_kernel(mesh, batch=batch, gamma=gamma, vocab=vocab), mesh)
    assert r.fits and r.bound == "memory"
    # it reads every probability once (and the noise, one row per batch row): between one read of
    # p and q and 1.2 of it. (12 rows per chip in the last case: not a multiple of 8, one block of
    # all rows.) Tiny arrays are not in the list: XLA prefetches operands that fit in VMEM into
    # it and the cost model counts that copy on top of the kernel's own reads.
    assert r.notes["pq_bytes"] <= r.bytes_accessed <= 1.2 * r.notes["pq_bytes"]



@pytest.mark.parametrize("batch,gamma,vocab", [(256, 8, 151936), (64, 8, 32000), (32, 4, 151936),
                                               (32, 3, 32000)])
def test_two_phase_rejection_kernel_compiles_for_tpu_below_half_a_read(batch, gamma, vocab):
    mesh = aot.topology_mesh(TOPOLOGY, {"data": -1})
    r = _compile(aot.rejection_kernel(mesh, batch=batch, gamma=gamma, vocab=vocab,
                                      backend="mosaic_tpu_two_phase"), mesh)
    assert r.fits and r.bound == "memory"
    # What it must read: one row of p, of q and of the noise per batch row, 3 / (2K + 1) of one
    # read of p and q. On top: K 128-lane chunks of p and q per row (under 2.2 % of the rows at
    # these shapes), the noise's partial last tile (2.4 % at V = 32,000) and [B, K]-sized work
    # around the kernels; under 15 % in all.
    rows = r.notes["pq_bytes"] * 3 / (2 * gamma + 1)
    assert rows <= r.bytes_accessed <= 1.15 * rows
    assert r.bytes_accessed < 0.5 * r.notes["pq_bytes"]

def test_oversized_config_is_reported_not_fitting_with_its_numbers():
    # 151,936-token vocabulary, 32 x 1024 tokens per chip: the f32 logits alone are 18.5 GiB per
    # chip, more than a v5e's 16 GiB (8 x 1024 per chip fits: 5.1 GiB).
    c = _train_config(batch_size=128, seq_len=1024)
    c.model.overrides.vocab_size = 151936
    mesh = aot.topology_mesh(TOPOLOGY, c.mesh.to_dict())
    big = aot.compile_program(aot.train_step(c, mesh), mesh, TOPOLOGY, explain_memory=True)
    assert not big.fits
    assert big.used_bytes > aot.HBM_BUDGET * big.hbm_bytes
    assert big.compiled or "RESOURCE_EXHAUSTED" in big.error
    assert big.used_bytes > 0 and big.hbm_bytes == 16 * 2**30
    row = big.to_dict()
    assert row["fits"] is False and row["hbm_fraction"] > aot.HBM_BUDGET
    # and says why, refused or not: the largest thing alive at its peak is those f32 logits
    top = big.notes["peak_live"]["groups"][0]
    assert top["shape"] == "f32[32,1024,151936]" and top["count"] == 1
    assert top["bytes"] == 32 * 1024 * 151936 * 4


def test_explain_memory_names_the_buffer_that_fills_the_peak():
    """``explain_memory=True`` reads what is alive at the compiled program's peak from XLA's dump:
    a sort must hold its whole ``[n, n]`` operand, so an ``f32[n, n]`` group is there."""
    import jax
    import jax.numpy as jnp

    from specjax.aot.compile import replicated_like
    n = 2048
    mesh = aot.topology_mesh(TOPOLOGY, {"data": -1})
    vec = replicated_like(jax.ShapeDtypeStruct((n,), jnp.float32), mesh)
    fn = jax.jit(lambda a, b: jnp.sort(jnp.outer(a, b), axis=1)[:, :8])
    r = aot.compile_report("sort_outer", lambda: fn.lower(vec, vec), mesh, TOPOLOGY,
                           explain_memory=True)
    live = r.notes["peak_live"]
    assert r.compiled and live is not None, r.notes
    assert sum(g["bytes"] for g in live["groups"]) == live["peak_bytes"]
    square = [g for g in live["groups"] if g["shape"] == f"f32[{n},{n}]"]
    assert square and square[0]["bytes"] >= n * n * 4
    assert 0 <= square[0]["first_start"] <= live["peak_position"] <= live["program_length"]
    # every value alive at the peak sits in the program's arguments, outputs or temporaries
    assert live["peak_bytes"] <= r.used_bytes
    assert "alive at the peak" in aot.format_breakdown(live)
    # compiler options reach the compiler: an unknown one is refused by name
    with pytest.raises(Exception, match="xla_no_such_option"):
        aot.compile_report("sort_outer", lambda: fn.lower(vec, vec), mesh, TOPOLOGY,
                           compiler_options={"xla_no_such_option": True})


def test_windowed_einsum_loops_are_counted_once_by_the_cost_analysis():
    """What docs/TPU.md says of the table's FLOPs: on 8 chips an FSDP matmul compiles to a
    windowed einsum, a loop whose body XLA's cost analysis counts once, so the compiled FLOPs
    fall short of the matmul's; with windowed einsums off they are the matmul's own. (If a libtpu
    counts the loop's trips, this fails: the docs' caveat is then stale.)"""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = aot.topology_mesh("v5e:2x4", {"data": 1, "fsdp": -1, "tensor": 1})
    split = NamedSharding(mesh, PartitionSpec("fsdp"))
    b, t, d, f = 8, 4096, 4096, 12288  # one Qwen3-8B MLP input projection, one row per chip
    x = jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16, sharding=split)
    w = jax.ShapeDtypeStruct((d, f), jnp.bfloat16, sharding=split)
    fn = jax.jit(lambda x, w: jnp.einsum("btd,df->btf", x, w), out_shardings=split)
    matmul = 2 * b * t * d * f / 8  # per chip
    windowed = aot.compile_report("mm", lambda: fn.lower(x, w), mesh, "v5e:2x4")
    plain = aot.compile_report(
        "mm", lambda: fn.lower(x, w), mesh, "v5e:2x4",
        compiler_options={"xla_tpu_enable_windowed_einsum_for_all_gather": False})
    assert plain.flops == pytest.approx(matmul, rel=1e-3)
    assert windowed.flops < 0.75 * matmul
    # Counted from the HLO with the loop's trips (specjax.aot.hlo_loops), both programs do the
    # matmul's FLOPs exactly (integers far below 2**53: exact in a float).
    for report in (windowed, plain):
        assert report.notes["loops"]["matmul_flops"] == matmul
        assert report.notes["loops"]["matmul_flops_once"] <= report.flops
        # one source line made this matmul: the einsum above (the split sums to the total)
        (line,) = report.notes["loops"]["by_source"]
        assert line["matmul_flops"] == matmul and "test_aot_tpu.py:" in line["source"]
    assert windowed.notes["loops"]["counted_loops"] >= 1
    assert windowed.loop_flops >= matmul > windowed.flops


@pytest.mark.parametrize("variant, anchors", [
    ("mtp_e2e_tv", None), ("mtp_e2e_tv", 0), ("dspark_markov", None), ("dspark_rnn", None),
    ("dflash", None), ("draft_lm", None)])
def test_drafter_train_steps_compile_at_their_model_flops(variant, anchors):
    """Every drafter's tiny train step compiles and fits, and its model FLOPs (the MFU's
    numerator: the frozen target's forward plus the drafter's own ``train_flops``) equal the
    matmuls the compiled step runs, counted from its HLO. The formulas count what each drafter computes: an MTP chain runs every depth's block
    over the whole sequence, DSpark's blocks attend to the whole context, ``W1`` is a lookup, the
    draft LM owns its head and does not use the target's. The one thing the count from the HLO
    does not see is a matrix-vector product the compiler runs as a multiply and a reduce (the
    confidence head's ``D + r`` weights: 0.034 % of the DSpark steps here); 0.2 % is six times
    that, and five times below the smallest error of the formulas these drafters had before
    (1.34x / 1.07x / 0.99x of the draft LM's / DSpark-Markov's / DFlash's matmuls)."""
    from experiments.configs.train_drafter import get_config
    c = get_config(f"{variant},tiny")
    if anchors is not None:  # every position an anchor: the target's full logits are gathered
        c.task.anchors_per_row = anchors
    mesh = aot.topology_mesh(TOPOLOGY, c.mesh.to_dict())
    report = _compile(aot.train_step(c, mesh), mesh)
    assert report.fits and report.name == f"drafter_step[{c.task.drafter}:{c.task.loss}]"
    matmuls = report.notes["loops"]["matmul_flops"]
    assert report.model_flops == pytest.approx(matmuls, rel=0.002)


def test_loop_aware_flops_do_not_depend_on_gradient_accumulation():
    """The same step with the batch in 1 or 4 microbatches does the same matmuls: the
    accumulation loop's trips are read from the HLO (the compiler's own count is of one
    microbatch), and the loop-aware count of both compiles is the same number."""
    counts = {}
    for accum in (1, 4):
        c = _train_config(batch_size=16)
        c.train.grad_accum_steps = accum
        mesh = aot.topology_mesh(TOPOLOGY, c.mesh.to_dict())
        report = _compile(aot.train_step(c, mesh), mesh)
        loops = report.notes["loops"]
        assert loops["matmul_flops_once"] <= report.notes.get("compiler_flops_once", report.flops)
        counts[accum] = loops["matmul_flops"]
        if accum > 1:
            assert any(row["trips"] == accum for row in loops["costliest"]), loops
            assert report.notes["compiler_flops_once"] < 0.5 * counts[1]
    assert counts[4] == counts[1]


def test_config_tpu_compiler_options_reach_the_compiled_train_step():
    """``config.train.tpu_compiler_options`` is in the trainer's jit when its mesh is a TPU's: the
    pre-flight compiles the step with it (an unknown name is refused by name) and records it."""
    c = _train_config()
    c.train.tpu_compiler_options = "xla_tpu_enable_latency_hiding_scheduler=false"
    mesh = aot.topology_mesh(TOPOLOGY, c.mesh.to_dict())
    program = aot.train_step(c, mesh)
    assert program.notes["compiler_options"] == {"xla_tpu_enable_latency_hiding_scheduler": False}
    assert aot.compile_program(program, mesh, TOPOLOGY).compiled
    c.train.tpu_compiler_options = "xla_tpu_no_such_option=1"
    with pytest.raises(Exception, match="xla_tpu_no_such_option"):
        aot.compile_program(aot.train_step(c, mesh), mesh, TOPOLOGY)


@pytest.mark.parametrize("order", ["host", "loop"])
def test_verification_step_does_not_copy_the_layered_cache_per_layer(order):
    """The TPU-compiled verification step copies the whole layered cache ``[L, S, max_len, ...]``
    at most four times (k and v converted to the compute layout and back), however many layers
    the model has, and each layer's rows ``[S, max_len, ...]`` at most four times. Handing the
    whole layered cache to the attention's window branches made the compiler copy it inside
    every branch of every layer (dozens of copies, growing with the layers). Both orders of the
    cache writes: inside the forward (the host loop's step) and after it (the device loop's)."""
    import re

    import jax
    from experiments.configs.train_drafter import get_config
    from specjax.models import get_preset
    task = get_config("draft_lm,tiny").task
    mesh = aot.topology_mesh(TOPOLOGY, {"data": 1, "fsdp": 1, "tensor": -1})
    max_len, slots = 512, 8
    for layers in (2, 4):
        shapes = aot.EngineShapes(num_slots=slots, max_len=max_len, gamma=3, buckets=(16,),
                                  prefill_chunk=16, loop_steps=0, verify_order=order)
        model = get_preset("tiny", num_kv_heads=4, num_layers=layers)
        verify = next(p for p in aot.engine_steps(model, task, mesh, shapes)
                      if p.name.startswith("engine.verify"))
        assert verify.name == ("engine.verify[N=16]" if order == "host"
                               else "engine.verify[N=16,loop]")
        with jax.set_mesh(mesh):
            text = verify.lower().compile().as_text()
        copies = [line for line in text.splitlines() if " copy(" in line]
        whole = [c for c in copies if re.search(rf"\[{layers},{slots},{max_len},", c)]
        rows = [c for c in copies if re.search(rf"\[{slots},{max_len},", c)]
        assert len(whole) <= 4, (layers, len(whole))
        assert len(rows) <= 4 * layers, (layers, len(rows))
        # the report's count: whole copies in any shape (a flattened [L*S*max_len, ...] too)
        assert aot.count_copies(text, verify.copy_watch) == len(whole), layers
        report = aot.compile_program(verify, mesh, TOPOLOGY)
        assert report.notes["whole_copies"] == len(whole)


def test_fsdp_keeps_the_batch_split_as_chips_grow(tmp_path):
    """Under FSDP the per-chip cost of a step at one row per chip must not grow with the chips.

    Two ways it did, both found by compiling for TPU:

    * The embedding lookup and the LM head came out of XLA's partitioner with the batch
      replicated (the weights' ``fsdp`` sharding of ``D`` won over the tokens' ``fsdp`` sharding
      of ``B``): this MTP + e2e-TV step needed 3.1 GiB of temporaries per chip on 4 chips and
      11.7 GiB on 16 (``experiments/fsdp_scaling.py``, 32,768-token vocabulary).
      ``specjax.models.partitioning.constrain_batch`` pins the batch.
    * The TV loss walks its ``[rows, V]`` logits in row chunks whose outer factor carries the
      batch sharding; at the Qwen3 vocabulary the default chunk was 48 rows, which 64 chips cannot
      split, so part of the logits was replicated on every chip (Qwen3-0.6B + MTP: 4.0 GiB of
      temporaries per chip on 8 chips, 15.1 GiB on 128). The chunk is now a multiple of the batch
      shards (``specjax.losses.tv._rows_per_chunk``).

    Every position is an anchor: the target's full ``[B, T, V]`` logits, its embedding and the
    drafter's shared head are all on the path. The 4-chip row comes from ``python -m
    experiments.fsdp_scaling --quick`` (its entry point), the 64-chip one from its
    ``compile_step``, both at the Qwen3 vocabulary.
    """
    import json
    from experiments.fsdp_scaling import compile_step, main, mtp_config
    vocab = 151936
    out = tmp_path / "scaling.json"
    rows = main(["--quick", "--vocab", str(vocab), "--out", str(out)])
    assert json.loads(out.read_text()) == rows
    assert [(r["step"], r["chips"], r["constrained"]) for r in rows] == [("mtp", 4, True)]
    (small,) = rows
    assert small["compiled"] and 0 < small["temp_gib"] < 16 and small["bytes_accessed_gb"] > 0
    topo, chips = "v5e:8x8", 64
    big = compile_step(mtp_config(topo, chips, vocab), topo)
    assert big.compiled, big.error
    assert big.mesh["fsdp"] == chips
    assert big.bytes_accessed / 1e9 <= 1.25 * small["bytes_accessed_gb"]
    assert big.temp_bytes / 2**30 <= 1.25 * small["temp_gib"] + 16 / 1024


def test_remat_study_trades_memory_for_recomputed_matmuls():
    """``experiments.fsdp_scaling --study remat`` on the tiny model: full remat recomputes each
    block's forward in the backward pass, so its loop-aware matmul FLOPs exceed those without
    remat (by at most the forward's share, a third of 6N plus the attention's), and it keeps less
    alive. The loss is chunked (a loop the cost analysis counts once): the loop-aware count is
    above the cost analysis' in both rows."""
    from experiments.fsdp_scaling import remat_study
    rows = remat_study(model="tiny", topology=TOPOLOGY, chips=4, rows_per_chip=(2,), seq=256,
                       logits_chunk=64, policies=("none", "full"))
    none, full = rows
    assert [(r["remat"], r["batch"], r["seq"]) for r in rows] == [("none", 8, 256), ("full", 8, 256)]
    for r in rows:
        assert r["compiled"] and r["fits"] and r["loop_flops"] > r["flops"]
    assert none["loop_flops"] < full["loop_flops"] <= 4 / 3 * none["loop_flops"]
    assert full["temp_gib"] < none["temp_gib"]


def test_tpu_plan_recounts_a_tables_model_flops_without_compiling(tmp_path):
    """``tpu_plan --table --recount_model_flops`` counts the model FLOPs of the rows already in
    ``--out``'s ``table.json`` again, and derives roofline and MFU from them: a committed row
    (Qwen3-0.6B + DSpark on v5e-8) with its model FLOPs halved, as a formula change would leave
    them, comes back as committed, the halved value kept in its notes. A row its pod config no
    longer builds (64 anchors per row, where it has 128) is refused, not recounted. Subprocesses: the entry point's
    absl flags must not meet another entry point's in this test process."""
    import json
    import os

    from _tiny_runs import ROOT, hermetic_env, run_module
    table = os.path.join(ROOT, "experiments", "results", "tpu", "table.json")
    (row,) = [r for r in json.load(open(table)) if (r["shapes"]["model"], r["shapes"]["drafter"],
                                                    r["topology"]) == ("qwen3-0.6b", "dspark",
                                                                       "v5e:2x4")]
    env = hermetic_env(tmp_path)
    out = tmp_path / "table"
    out.mkdir()
    (out / "table.json").write_text(json.dumps([{**row, "model_flops": row["model_flops"] / 2,
                                                 "mfu": row["mfu"] / 2, "notes": {}}]))
    run_module(env, "experiments.tpu_plan", "--table", "--recount_model_flops", "--out", out)
    (again,) = json.loads((out / "table.json").read_text())
    assert again["model_flops"] == row["model_flops"] and again["mfu"] == row["mfu"]
    assert again["notes"] == {"model_flops_compiled_with": row["model_flops"] / 2}
    assert (out / "table.md").read_text().count("drafter_step[dspark:dspark]") == 1
    (out / "table.json").write_text(json.dumps([{**row, "shapes": {**row["shapes"],
                                                                   "anchors_per_row": 64}}]))
    proc = run_module(env, "experiments.tpu_plan", "--table", "--recount_model_flops", "--out",
                      out, timeout=300, check=False)
    assert proc.returncode != 0 and "compile the table again" in proc.stderr


def test_in_process_tpu_compiles_leave_the_persistent_cache_alone():
    """In a process whose persistent compilation cache is on (this test worker's, like a
    notebook's), compiling the same TPU program twice neither writes it to the cache nor warns on
    the second compile that the entry cannot be read back (``compile_report`` compiles under
    ``aot.no_persistent_cache_writes``); the cache's own write threshold is restored after."""
    import warnings

    from experiments.configs.train_drafter import get_config
    from specjax.models import get_preset
    cache_dir = jax.config.jax_compilation_cache_dir
    assert cache_dir  # the worker's cache (conftest), the setting this test is about
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    task = get_config("mtp_e2e_tv,tiny").task
    mesh = aot.topology_mesh(TOPOLOGY, {"data": 1, "fsdp": 1, "tensor": -1})
    shapes = aot.EngineShapes(num_slots=4, max_len=128, gamma=3, buckets=(16,),
                              prefill_chunk=16, loop_steps=0)
    before = set(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the same program built and compiled again, past JAX's memory
            jax.clear_caches()
            draft = aot.engine_steps(get_preset("tiny", num_kv_heads=4), task, mesh, shapes)[0]
            assert _compile(draft, mesh).name == "engine.draft"
    assert not [w for w in caught if "persistent compilation cache" in str(w.message)]
    after = set(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else set()
    assert not {f for f in after - before if "draft_step" in f}, after - before
    assert jax.config.jax_persistent_cache_min_compile_time_secs == threshold


def test_tpu_plan_compiles_one_kind_of_engine_step(tmp_path):
    """``python -m experiments.tpu_plan --programs engine.prefill`` compiles the engine's prefill
    step alone (``engine`` would compile the draft, each verification bucket and the device loop
    too), here with ``--explain_memory``, an ``--xla_option`` and ``--engine_flops_context``, and
    leaves a configured
    persistent compilation cache empty. A subprocess: the entry point's
    absl flags (``--config``) must not meet another entry point's in this test process."""
    import json

    from _tiny_runs import hermetic_env, run_module
    env = hermetic_env(tmp_path)
    # with a persistent compilation cache configured, nothing is written to it (a TPU executable
    # could not be read back on this machine: the next run would warn and compile again)
    cache = tmp_path / "jax_cache"
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    run_module(env, "experiments.tpu_plan",
               "--config", "experiments/configs/train_drafter.py:mtp_e2e_tv,tiny",
               "--topology", TOPOLOGY, "--programs", "engine.prefill", "--engine_slots", 4,
               "--engine_max_len", 256, "--engine_flops_context", 100, "--out", tmp_path / "plan",
               "--explain_memory", "--xla_option", "xla_tpu_enable_latency_hiding_scheduler=false")
    rows = json.loads((tmp_path / "plan" / "plan.json").read_text())
    # its model FLOPs are the engine count at the context asked for, shared by the devices
    from experiments.configs.train_drafter import get_config
    from specjax.training.drafter_build import build_drafter
    from specjax.training.lm_task import model_config_from
    c = get_config("mtp_e2e_tv,tiny")
    target = model_config_from(c)
    shapes = aot.EngineShapes(num_slots=4, max_len=256, gamma=c.task.gamma, buckets=(4,),
                              prefill_chunk=256, flops_context=100)
    expected = aot.engine_flops(target, build_drafter(c.task, target)[0], shapes).prefill
    assert rows[0]["model_flops"] == pytest.approx(expected / rows[0]["num_devices"], rel=1e-9)
    assert not cache.exists() or not any(cache.iterdir())
    assert [r["name"] for r in rows] == ["engine.prefill[C=256]"]
    assert rows[0]["compiled"] and rows[0]["fits"] and "whole_copies" in rows[0]["notes"]
    notes = rows[0]["notes"]
    assert notes["compiler_options"] == {"xla_tpu_enable_latency_hiding_scheduler": False}
    live = notes["peak_live"]
    assert sum(g["bytes"] for g in live["groups"]) == live["peak_bytes"] <= rows[0]["used_bytes"]
