"""specjax.aot.peak: what is alive at a compiled program's memory peak, from XLA's dump files.

Hand-written dump texts in the format XLA writes (``*-live-range.txt`` peak section, optimized HLO
module text); no libtpu needed. The real compile is in ``tests/test_aot_tpu.py``.
"""
import pytest

from specjax.aot import peak

LIVE = """HloLiveRange (max 40):
  InstructionSequence:
    0:param.1
    1:custom-call.7
  BufferLiveRange:
    param.1{}:0-40
    custom-call.7{}:1-30
    custom-call.8{}:3-20
    while.3{2}:10-40
    fusion.5{}:17-17
  Live ranges at 17 (peak):
    custom-call.7{}: 100663296 bytes (cumulative: 100663296 bytes)
    custom-call.8{}: 100663296 bytes (cumulative: 201326592 bytes)
    while.3{2}: 67108864 bytes (cumulative: 268435456 bytes)
    param.1{}: 1048576 bytes (cumulative: 269484032 bytes)
    fusion.5{}: 4096 bytes (cumulative: 269488128 bytes)
    ghost.9{}: 16 bytes (cumulative: 269488144 bytes)
  Stack trace breakdown for peak usage: 269 488 144 bytes
    main (100.0%, total: 269 488 144 bytes)
"""

HLO = """HloModule jit__train_step, entry_computation_layout={()->()}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %custom-call.7 = bf16[1,4096,12288]{2,1,0:T(8,128)(2,1)} custom-call(), custom_call_target="AllocateBuffer", backend_config={"flag_configs":[]}
  %custom-call.8 = bf16[1,4096,12288]{2,1,0:T(8,128)(2,1)} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %fusion.5 = f32[32,32]{1,0:T(8,128)} fusion(%custom-call.7), kind=kLoop, calls=%f, metadata={op_name="jit(_train_step)/while/body/closed_call/jvp(btd,df->btf)/dot_general" stack_frame_id=3}
}

ENTRY %main {
  %param.1 = bf16[512,1024]{1,0:T(8,128)(2,1)} parameter(0), sharding={devices=[8,1]<=[8]}, metadata={op_name="frozen[\\'target\\'][\\'lm_head\\']"}
  %while.3 = (s32[]{:T(128)}, f32[8]{0}, /*index=2*/f32[4096,4096]{1,0:T(8,128)}) while(%tuple.2), condition=%cond, body=%body
}
"""


def test_breakdown_groups_the_peak_by_source_and_shape():
    r = peak.breakdown(LIVE, HLO)
    assert r["values"] == 6
    assert r["peak_bytes"] == 269488144  # the file's own peak: every value is counted once
    assert (r["peak_position"], r["program_length"]) == (17, 40)
    assert sum(g["bytes"] for g in r["groups"]) == r["peak_bytes"]
    assert r["groups"] == [
        # first and last start of the group's live ranges
        {"label": "AllocateBuffer", "shape": "bf16[1,4096,12288]", "count": 2,
         "bytes": 2 * 100663296, "first_start": 1, "last_start": 3, "first_end": 20,
         "last_end": 30},
        # a tuple element takes its element's shape, not the tuple's first
        {"label": "while", "shape": "f32[4096,4096]", "count": 1, "bytes": 67108864,
         "first_start": 10, "last_start": 10, "first_end": 40, "last_end": 40},
        # parameters carry their argument's pytree path
        {"label": "parameter frozen['target']['lm_head']", "shape": "bf16[512,1024]",
         "count": 1, "bytes": 1048576, "first_start": 0, "last_start": 0, "first_end": 40,
         "last_end": 40},
        # the jit / while / closed_call scopes are dropped from the op name
        {"label": "fusion jvp(btd,df->btf)/dot_general", "shape": "f32[32,32]", "count": 1,
         "bytes": 4096, "first_start": 17, "last_start": 17, "first_end": 17, "last_end": 17},
        # a name the HLO text does not define is kept, so the groups still sum to the peak
        {"label": "<unknown>", "shape": "", "count": 1, "bytes": 16, "first_start": None,
         "last_start": None, "first_end": None, "last_end": None},
    ]


def test_breakdown_cuts_to_top_groups_plus_the_rest():
    r = peak.breakdown(LIVE, HLO, top=2)
    assert [g["label"] for g in r["groups"]] == ["AllocateBuffer", "while", "other"]
    assert r["groups"][-1] == {"label": "other", "shape": "", "count": 3,
                               "bytes": 1048576 + 4096 + 16, "first_start": 0,
                               "last_start": 17, "first_end": 17, "last_end": 40}
    assert sum(g["bytes"] for g in r["groups"]) == r["peak_bytes"]


def test_no_peak_section_is_none():
    assert peak.breakdown("HloLiveRange (max 3):\n  InstructionSequence:\n", HLO) is None
    assert peak.parse_peak("") == (None, [])
    assert peak.parse_ranges("") == (None, {})


def test_peak_breakdown_reads_the_module_with_the_largest_peak(tmp_path):
    small = LIVE.replace("Live ranges at 17 (peak):\n", "Live ranges at 2 (peak):\n").split(
        "    custom-call.8")[0]
    for stem, live in (("module_0001.jit_small.after_optimizations", small),
                       ("module_0004.jit__train_step.after_optimizations", LIVE)):
        (tmp_path / f"{stem}-live-range.txt").write_text(live)
        (tmp_path / f"{stem}.txt").write_text(HLO)
    # a live-range file without its module text is skipped
    (tmp_path / "module_0009.x.after_optimizations-live-range.txt").write_text(LIVE * 2)
    r = peak.peak_breakdown(str(tmp_path))
    assert r["module"] == "module_0004.jit__train_step.after_optimizations.txt"
    assert r["peak_bytes"] == 269488144
    assert peak.peak_breakdown(str(tmp_path / "missing")) is None


def test_format_breakdown_lists_every_group():
    r = peak.breakdown(LIVE, HLO)
    text = peak.format_breakdown(r)
    lines = text.splitlines()
    assert lines[0].strip().startswith(
        "alive at the peak (position 17 of 40): 257.0 MiB in 6 values")
    assert len(lines) == 1 + len(r["groups"])
    assert "192.0 MiB" in lines[1]
    assert "2 x  AllocateBuffer bf16[1,4096,12288]  [start 1-3, end 20-30]" in lines[1]
    assert lines[-1].rstrip().endswith("<unknown>")  # no live range known: no positions
    assert "1.0 MiB" in lines[3] and "4.0 KiB" in lines[4]  # the parameter, the fusion


@pytest.mark.parametrize("type_text,index,shape", [
    ("f32[8,128]{1,0:T(8,128)}", "", "f32[8,128]"),
    ("pred[]", "", "pred[]"),
    ("(s32[]{:T(128)}, bf16[2,3]{1,0}, /*index=2*/f8e4m3fn[4]{0})", "1", "bf16[2,3]"),
    ("(s32[]{:T(128)}, bf16[2,3]{1,0}, /*index=2*/f8e4m3fn[4]{0})", "2", "f8e4m3fn[4]"),
])
def test_element_shapes(type_text, index, shape):
    assert peak._element_shape(type_text, index) == shape
