"""Reading a disassembly (hf_asymkv.kernels.sass) on hand-written SASS: classes, the main loop, resources."""

from __future__ import annotations

import pytest

from hf_asymkv.kernels import sass

# a kernel with a short loop (0x0040..0x0090) inside a longer one (0x0020..0x00c0), and a forward branch
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;       /* 0x0000000402047981 */
        /*0030*/                   LOP3.LUT R8, R4, 0xf000f, RZ, 0xc0, !PT ; /* 0x000f000f04087812 */
        /*0040*/                   PRMT R9, R5, 0x7632, R9 ;             /* 0x0000763205097816 */
        /*0050*/                   HMMA.16816.F32 R12, R8, R10, R12 ;     /* 0x0000000a080c723c */
        /*0060*/                   F2FP.F16.F32.PACK_AB R9, R13, R12 ;    /* 0x0000000c0d09723e */
        /*0070*/               @P1 BRA 0xb0 ;                             /* 0x0000000000001947 */
        /*0080*/                   LDSM.16.M88.4 R16, [R3] ;              /* 0x000000000310783b */
        /*0090*/              @!P0 BRA 0x40 ;                             /* 0xffffffa000008947 */
        /*00a0*/                   FFMA R6, R7, R8, R6 ;                  /* 0x0000000807067223 */
        /*00b0*/                   UIADD3 UR4, UR4, 0x1, URZ ;           /* 0x0000000104047890 */
        /*00c0*/               @P2 BRA 0x20 ;                             /* 0xffffff5000002947 */
        /*00d0*/                   STL [R1], R6 ;                         /* 0x0000000601007387 */
        /*00e0*/                   EXIT ;                                 /* 0x000000000000794d */
"""

CLASSES = {"LDG.E.128 R4, desc[UR4][R2.64]": "global", "@P0 LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]": "global",
           "I2F.F16 R1, R2": "conversion", "F2FP.BF16.F32.PACK_AB R1, R2, R3": "conversion",
           "LOP3.LUT R8, R4, 0xf000f, RZ, 0xc0, !PT": "integer", "UIADD3 UR4, UR4, 0x1, URZ": "integer",
           "@!P2 IMAD.MOV.U32 R1, RZ, RZ, R2": "integer", "FFMA R6, R7, R8, R6": "float", "MUFU.EX2 R1, R2": "float",
           "HMMA.16816.F32.BF16 R12, R8, R10, R12": "mma", "HGMMA.64x64x16.F32 R24, gdesc[UR4], R24": "mma",
           "BAR.SYNC.DEFER_BLOCKING 0x0": "shared_sync", "SHFL.BFLY PT, R1, R2, 0x1, 0x1f": "shared_sync",
           "MOV R1, R2": "other", "@P1 BRA 0xb0": "other", "STL [R1], R6": "other"}


@pytest.mark.parametrize("instruction", list(CLASSES), ids=list(CLASSES))
def test_classify(instruction):
    assert sass.classify(instruction) == CLASSES[instruction]


def test_instructions_in_address_order():
    listing = sass.instructions(LISTING)
    assert [a for a, _ in listing] == list(range(0, 0xF0, 0x10))
    assert listing[7] == (0x70, "@P1 BRA 0xb0")


def test_main_loop_is_the_largest_backward_branch():
    loop = sass.main_loop(LISTING)
    assert loop[0].startswith("LDG.E.128") and loop[-1] == "@P2 BRA 0x20" and len(loop) == 11


def test_no_loop():
    assert sass.main_loop(LISTING.replace("BRA 0x40", "BRA 0xe0").replace("BRA 0x20", "BRA 0xe0")) == []


def test_resources_parsed_from_cuobjdump_output():
    usage = " Function partial_attention_kernel:\n  REG:130 STACK:0 SHARED:1024 LOCAL:16 CONSTANT[0]:984 TEXTURE:0"
    assert [sass.resource(usage, name) for name in ("REG", "SHARED", "LOCAL", "STACK", "TEXTURE")] == [130, 1024, 16, 0, 0]


def test_cuda_target_answers_the_capability():
    from triton.runtime import driver

    with sass.cuda_target(89):
        target = driver.active.get_current_target()
        assert (target.backend, target.arch, target.warp_size) == ("cuda", 89, 32)


def test_loops_are_every_backward_branch():
    found = sass.loops(LISTING)
    assert [len(body) for body in found] == [6, 11]  # the inner loop (0x40..0x90), then the outer (0x20..0xc0)


# two loops of equal length: a code loop (PRMT, the magic-number conversion) and an exact segment's loop (none)
TWO_LOOPS = """
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/                   HMMA.16816.F32 R12, R8, R10, R12 ;
        /*0020*/                   IADD3 R2, R2, 0x80, RZ ;
        /*0030*/              @!P0 BRA 0x0 ;
        /*0040*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0050*/                   PRMT R9, R5, 0x5140, R9 ;
        /*0060*/                   HMMA.16816.F32 R12, R8, R10, R12 ;
        /*0070*/              @!P1 BRA 0x40 ;
        /*0080*/                   EXIT ;
"""


def test_code_loop_is_the_loop_that_converts_codes():
    assert sass.code_loop(TWO_LOOPS)[1] == "PRMT R9, R5, 0x5140, R9"  # not the first loop, as long
    assert sass.code_loop(TWO_LOOPS.replace("PRMT R9, R5, 0x5140, R9", "MOV R9, R5")) == sass.loops(TWO_LOOPS)[0]
    assert len(sass.code_loop(LISTING)) == 11  # the PRMT is in both nested loops: the longer one


# nvdisasm -g: line notes before the instructions they cover; labels instead of branch addresses
NVDISASM = """
        .text.partial_attention_kernel:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
	//## File "/src/hf_asymkv/kernels/triton_codes.py", line 56
        /*0010*/                   LOP3.LUT R8, R4, 0xf000f, RZ, 0xc0, !PT ;
        /*0020*/                   PRMT R9, R5, 0x5140, R9 ;
.L_x_1:
	//## File "/src/hf_asymkv/kernels/triton_codes.py", line 118
        /*0030*/                   HMMA.16816.F32 R12, R8, R10, R12 ;
	//## File "/venv/triton/language/standard.py", line 263
        /*0040*/              @!P0 BRA `(.L_x_1) ;
"""


def test_line_table_follows_the_notes():
    assert sass.line_table(NVDISASM) == {0x10: ("triton_codes.py", 56), 0x20: ("triton_codes.py", 56),
                                         0x30: ("triton_codes.py", 118), 0x40: ("standard.py", 263)}
    assert sass.instructions(NVDISASM)[-1] == (0x40, "@!P0 BRA `(.L_x_1)")  # the listing's own lines parse alike


def _ttgir(layout: str, operand_layout: str = "#blocked1") -> str:
    """A TTGIR excerpt: one layout definition and one join of two plane sets (the PTX shortened) over it."""
    return (f"{layout}\n"
            f'    %x = tt.elementwise_inline_asm "{{ shf.r.wrap.b32 a, $2, $2, $4; prmt.b32 $0, a, 0, 0; }}" '
            f"%a, %b : tensor<128x128xi8, {operand_layout}>, tensor<128x128xi8, {operand_layout}> "
            f"-> tensor<128x128xf16, {operand_layout}> loc(#loc1)\n"
            f'    %y = tt.elementwise_inline_asm "{{ lop3.b32 t, $2, $3, $4, 0x6a; }}" %c : '
            f"tensor<64x128xi8, #blocked9> -> tensor<64x128xf16, #blocked9>\n")


def test_joined_codes_must_be_grouped_by_token():
    # the layout the compiler gives the joins (16 channels of one token per thread): fine; the magic conversion on
    # another line is not a join and its undefined layout is not looked at
    good = "#blocked1 = #ttg.blocked<{sizePerThread = [1, 16], threadsPerWarp = [4, 8], warpsPerCTA = [4, 1], order = [1, 0]}>"
    assert sass.joined_ops(_ttgir(good)) == 1 and sass.joined_groups_by_token(_ttgir(good)) == []
    narrow = good.replace("[1, 16]", "[1, 2]")  # two channels per thread: a group of four spans two tokens' rows
    tokens = good.replace("[1, 16]", "[16, 1]").replace("order = [1, 0]", "order = [0, 1]")  # tokens run fastest
    for bad in (narrow, tokens):
        assert sass.joined_groups_by_token(_ttgir(bad)) == [
            f"joined codes in layout #blocked1 (sizePerThread {'[1, 2]' if bad is narrow else '[16, 1]'}, order "
            f"{'[1, 0]' if bad is narrow else '[0, 1]'})"]
    assert sass.joined_groups_by_token(_ttgir(good, "#mma")) == ["joined codes in layout #mma (sizePerThread None, "
                                                                  "order None)"]
