"""specjax.aot.hlo_loops: matmul FLOPs of an HLO module with every loop's trips counted.

Hand-written HLO texts in the format ``compiled.as_text()`` prints; every expected count is
worked out in the comments. No libtpu needed; the TPU compiles (a windowed einsum, gradient
accumulation) are in ``tests/test_aot_tpu.py``.
"""
import pytest

from specjax.aot import hlo_loops

# A dot [4, 8] x [8, 16] -> [4, 16]: 2 * 4 * 16 * 8 = 1024 FLOPs.
_DOT_BODY = """
%body (p: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16]) {
  %p = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %w = f32[8,16]{1,0} get-tuple-element(%p), index=2
  %d = f32[4,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/while/body/dot_general"}
  %step = s32[] constant(STEP)
  %next = s32[] add(%i, %step)
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%next, %x, %w)
}

%cond (q: (s32[], f32[4,8], f32[8,16])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %bound = s32[] constant(BOUND)
  ROOT %c = pred[] compare(LHS, RHS), direction=DIR
}

ENTRY %main (a: f32[4,8], b: f32[8,16]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,16]{1,0} parameter(1)
  %zero = s32[] constant(START)
  %init = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%zero, %a, %b)
  %loop = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(step)/while"}
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def _loop(start=0, bound=5, step=1, direction="LT", counter_first=True):
    lhs, rhs = ("%j", "%bound") if counter_first else ("%bound", "%j")
    return (_DOT_BODY.replace("START", str(start)).replace("BOUND", str(bound))
            .replace("STEP", str(step)).replace("DIR", direction).replace("LHS", lhs)
            .replace("RHS", rhs))


@pytest.mark.parametrize("kw, trips", [
    ({}, 5),                                                  # for i in range(5)
    ({"start": 2, "bound": 9, "step": 3}, 3),                 # i = 2, 5, 8
    ({"direction": "LE", "bound": 4}, 5),                     # i <= 4: 0..4
    ({"direction": "NE", "bound": 6, "step": 2}, 3),          # i != 6: 0, 2, 4
    ({"direction": "GT", "bound": 5, "counter_first": False}, 5),  # 5 > i
    ({"start": 5, "bound": 0, "step": -1, "direction": "GT"}, 5),  # i = 5 .. 1
    ({"bound": 0}, 0),                                        # never runs
])
def test_a_loop_counts_its_trips(kw, trips):
    counted = hlo_loops.loop_flops(_loop(**kw))
    assert counted.once == 1024  # how the compiler's cost analysis counts: the body once
    assert counted.total == 1024 * trips
    assert counted.extra == 1024 * (trips - 1)
    assert counted.loops == [("while", trips, 1024)]  # named by its JAX op, scopes stripped
    assert counted.unknown_loops == []


def test_a_loop_without_a_readable_trip_count_is_counted_once_and_listed():
    # The condition compares the counter with a loop-carried value (a while_loop on data).
    text = _loop().replace("ROOT %c = pred[] compare(%j, %bound)",
                           "%n = s32[] get-tuple-element(%q), index=0\n"
                           "  ROOT %c = pred[] compare(%j, %n)")
    counted = hlo_loops.loop_flops(text)
    assert (counted.total, counted.once, counted.loops) == (1024, 1024, [])
    assert counted.unknown_loops == ["loop"]
    # A step that is not a constant: unknown too.
    counted = hlo_loops.loop_flops(_loop().replace("%next = s32[] add(%i, %step)",
                                                   "%next = s32[] add(%i, %i)"))
    assert counted.unknown_loops == ["loop"] and counted.total == 1024


def test_known_trip_count_annotation_wins():
    text = _loop(bound=5).replace(
        'while(%init), condition=%cond, body=%body,',
        'while(%init), condition=%cond, body=%body, '
        'backend_config={"known_trip_count":{"n":"7"}},')
    assert hlo_loops.loop_flops(text).total == 7 * 1024


def test_nested_loops_multiply():
    # The outer body runs the inner loop (4 trips of the 1024-FLOP dot) and one more dot of its
    # own; the outer loop runs 3 times: 3 * (4 * 1024 + 1024) = 15360. Counted once: 2048.
    inner = _loop(bound=4)
    inner = inner.replace("%body", "%ibody").replace("%cond", "%icond").replace(
        "ENTRY %main (a: f32[4,8], b: f32[8,16]) -> f32[4,8]",
        "%obody (op: (s32[], f32[4,8], f32[8,16])) -> (s32[], f32[4,8], f32[8,16])")
    inner = inner.replace("""  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,16]{1,0} parameter(1)
  %zero = s32[] constant(0)""", """  %op = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %oi = s32[] get-tuple-element(%op), index=0
  %a = f32[4,8]{1,0} get-tuple-element(%op), index=1
  %b = f32[8,16]{1,0} get-tuple-element(%op), index=2
  %od = f32[4,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %onext = s32[] add(%oi, %one)
  %zero = s32[] constant(0)""").replace(
        "  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1",
        "  ROOT %ot = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%onext, %a, %b)")
    text = inner + """
%ocond (oq: (s32[], f32[4,8], f32[8,16])) -> pred[] {
  %oq = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %oj = s32[] get-tuple-element(%oq), index=0
  %three = s32[] constant(3)
  ROOT %oc = pred[] compare(%oj, %three), direction=LT
}

ENTRY %main (a0: f32[4,8], b0: f32[8,16]) -> f32[4,8] {
  %a0 = f32[4,8]{1,0} parameter(0)
  %b0 = f32[8,16]{1,0} parameter(1)
  %z0 = s32[] copy(s32[] %zc)
  %zc = s32[] constant(0)
  %oinit = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%z0, %a0, %b0)
  %outer = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}) while(%oinit), condition=%ocond, body=%obody
  ROOT %r = f32[4,8]{1,0} get-tuple-element(%outer), index=1
}
"""
    counted = hlo_loops.loop_flops(text)
    assert counted.total == 3 * (4 * 1024 + 1024)
    assert counted.once == 2048
    # (source, trips, FLOPs of one trip), costliest first: the outer loop's trip includes the
    # inner loop's four.
    assert counted.loops == [("outer", 3, 5 * 1024), ("while", 4, 1024)]


_CONV = """
%fused (p0: f32[1,4,2], p1: f32[3,2,5]) -> f32[1,4,5] {
  %p0 = f32[1,4,2]{2,1,0} parameter(0)
  %p1 = f32[3,2,5]{2,1,0} parameter(1)
  ROOT %conv = f32[1,OUT,5]{2,1,0} convolution(%p0, %p1), window={WINDOW}, dim_labels=b0f_0io->b0f
}

ENTRY %main (x: f32[1,4,2], k: f32[3,2,5]) -> f32[1,4,5] {
  %x = f32[1,4,2]{2,1,0} parameter(0)
  %k = f32[3,2,5]{2,1,0} parameter(1)
  ROOT %f = f32[1,OUT,5]{2,1,0} fusion(%x, %k), kind=kOutput, calls=%fused
}
"""


@pytest.mark.parametrize("window, out, taps", [
    # 4 inputs, 3 taps, padding 1 on each side, 4 outputs: the taps that land on an input are
    # 2 (o=0: the first tap reads padding), 3, 3, 2 (o=3: the last tap reads padding) = 10.
    ("size=3 pad=1_1", 4, 10),
    # No padding: 2 outputs x 3 taps, all on inputs.
    ("size=3", 2, 6),
    # Input dilated by 2 (x0 _ x1 _ x2 _ x3: 7 positions), 3 taps, 5 outputs: the taps on a real
    # element are o=0: k=0, 2 / o=1: k=1 / o=2: k=0, 2 / o=3: k=1 / o=4: k=0, 2 -> 8.
    ("size=3 lhs_dilate=2", 5, 8),
    # Stride 2 over 4 inputs, 2 taps: outputs at 0 and 2 read (0, 1) and (2, 3): 4.
    ("size=2 stride=2", 2, 4),
])
def test_convolution_counts_the_taps_that_read_an_input(window, out, taps):
    # FLOPs = 2 x batch 1 x output features 5 x taps x input features 2.
    text = _CONV.replace("WINDOW", window).replace("OUT", str(out))
    counted = hlo_loops.loop_flops(text)
    assert counted.total == counted.once == 2 * 5 * taps * 2


def test_a_conditional_counts_its_costliest_branch():
    text = """
%small (s: f32[4,8]) -> f32[4,8] {
  ROOT %s = f32[4,8]{1,0} parameter(0)
}

%big (g: (f32[4,8], f32[8,16])) -> f32[4,16] {
  %g = (f32[4,8]{1,0}, f32[8,16]{1,0}) parameter(0)
  %gx = f32[4,8]{1,0} get-tuple-element(%g), index=0
  %gw = f32[8,16]{1,0} get-tuple-element(%g), index=1
  ROOT %gd = f32[4,16]{1,0} dot(%gx, %gw), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (i: s32[], x: f32[4,8], w: f32[8,16]) -> f32[4,16] {
  %i = s32[] parameter(0)
  %x = f32[4,8]{1,0} parameter(1)
  %w = f32[8,16]{1,0} parameter(2)
  %xw = (f32[4,8]{1,0}, f32[8,16]{1,0}) tuple(%x, %w)
  ROOT %c = f32[4,16]{1,0} conditional(%i, %x, %xw), branch_computations={%small, %big}
}
"""
    counted = hlo_loops.loop_flops(text)
    assert counted.total == counted.once == 1024


def test_unreadable_text_is_an_error():
    with pytest.raises(ValueError, match="ENTRY"):
        hlo_loops.loop_flops("%f (x: f32[]) -> f32[] {\n  ROOT %x = f32[] parameter(0)\n}\n")


def test_matmul_flops_are_split_by_the_source_line_that_made_them():
    # The module's source tables (as `compiled.as_text()` prints them) and two dots: one in the
    # loop body (5 trips of 1024 FLOPs, frame 2) and one in the entry (1024 FLOPs, frame 1).
    tables = """HloModule m

FileNames
1 "/home/someone/checkout/specjax/models/layers.py"
2 "/opt/venv/lib/python3.11/site-packages/optax/_src/alias.py"
3 "/somewhere/else/train_script.py"

FunctionNames
1 "MLP.__call__"
2 "adamw"
3 "<module>"

FileLocations
1 {file_name_id=1 function_name_id=1 line=40 end_line=40 column=1 end_column=9}
2 {file_name_id=3 function_name_id=3 line=7 end_line=7 column=1 end_column=9}
3 {file_name_id=2 function_name_id=2 line=3 end_line=3 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=1}
"""
    body = _loop().replace('metadata={op_name="jit(step)/while/body/dot_general"}',
                           'metadata={op_name="jit(step)/while/body/dot_general" '
                           'stack_frame_id=2}')
    body = body.replace(
        "  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1",
        "  %e = f32[4,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, "
        "metadata={op_name=\"jit(step)/dot_general\" stack_frame_id=1}\n"
        "  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1")
    counted = hlo_loops.loop_flops(tables + body)
    assert counted.total == 6 * 1024
    # paths from the package directory on (no machine directories), else the file's name
    assert counted.by_source == [("train_script.py:7 (<module>)", 5 * 1024),
                                 ("specjax/models/layers.py:40 (MLP.__call__)", 1024)]
    assert hlo_loops._short_path("/opt/venv/lib/python3.11/site-packages/optax/_src/alias.py") \
        == "optax/_src/alias.py"
    # without the tables every matmul's source is unknown, and the split still sums up
    assert hlo_loops.loop_flops(body).by_source == [("", 6 * 1024)]
