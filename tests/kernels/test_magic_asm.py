"""The inline PTX of the fast path (``MAGIC_ASM``, ``JOIN_ASM``: what the kernel runs on a GPU) computes what its
plain Triton twin computes (what the interpreter tests run): the PTX is executed here by a small emulator of the
instructions it uses (``lop3``, ``prmt``, ``shf``, ``and``, per the PTX ISA), on every byte value in every lane, with
the masks, flips and rotations the kernel passes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hf_asymkv.kernels.triton_codes import JOIN_ASM, MAGIC_ASM, MAGIC_SUB_ASM


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX ``lop3.b32``: bit i of the result is bit ``4 a_i + 2 b_i + c_i`` of ``lut``."""
    out = 0
    for i in range(32):
        index = ((a >> i & 1) << 2) | ((b >> i & 1) << 1) | (c >> i & 1)
        out |= (lut >> index & 1) << i
    return out


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): result byte i is byte ``selector[4i:4i+3] & 7`` of ``{b, a}`` (a the low four
    bytes), or that byte's sign replicated when the selector nibble's bit 3 is set."""
    pool = (b << 32) | a
    out = 0
    for i in range(4):
        nibble = selector >> (4 * i) & 0xF
        byte = pool >> (8 * (nibble & 7)) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _shf_r_wrap(a: int, b: int, c: int) -> int:
    """PTX ``shf.r.wrap.b32 d, a, b, c``: the low 32 bits of the 64-bit ``{b, a}`` (``a`` the low half) shifted right
    by ``c & 31``."""
    return (((b << 32) | a) >> (c & 31)) & 0xFFFFFFFF


def _halves(word: int) -> np.ndarray:
    return np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16)


def _sub_f16x2(a: int, b: int) -> int:
    """PTX ``sub.f16x2``: two fp16 subtractions, lane by lane (IEEE, round to nearest even)."""
    bits = (_halves(a) - _halves(b)).view(np.uint16)
    return int(bits[0]) | int(bits[1]) << 16


def run_ptx(asm: str, operands: dict[str, int]) -> dict[str, int]:
    """Execute ``asm`` (the subset above, ``.reg`` declarations, immediates in hex) on 32-bit ``operands`` (``$0``...)."""
    regs = dict(operands)

    def value(token: str) -> int:
        token = token.strip()
        return int(token, 16) & 0xFFFFFFFF if token.startswith("0x") else regs[token]

    for statement in asm.strip().strip("{}").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, args = statement.split(None, 1)
        args = [a.strip() for a in args.split(",")]
        if op == "lop3.b32":
            regs[args[0]] = _lop3(value(args[1]), value(args[2]), value(args[3]), value(args[4]))
        elif op == "prmt.b32":
            regs[args[0]] = _prmt(value(args[1]), value(args[2]), value(args[3]))
        elif op == "sub.f16x2":
            regs[args[0]] = _sub_f16x2(value(args[1]), value(args[2]))
        elif op == "shf.r.wrap.b32":
            regs[args[0]] = _shf_r_wrap(value(args[1]), value(args[2]), value(args[3]))
        elif op == "and.b32":
            regs[args[0]] = value(args[1]) & value(args[2])
        else:
            raise AssertionError(f"the emulator does not know {op!r}: extend it with the PTX ISA's definition")
    return regs


def plain(byte: int, mask: int, flip: int) -> int:
    """The plain twin (``magic_fp16`` without ``ASM``) as fp16 bits: ``0x6400 | ((byte & mask) ^ flip)``."""
    return 0x6400 | ((byte & mask) ^ flip)


# (mask, flip) per byte as the kernel passes them: 8-bit codes (int8 flipped to offset binary, uint8 as is), every
# field of every plane width, the wide channels' bits
CASES = {"int8": (0xFF, 0x80), "uint8": (0xFF, 0x00),
         **{f"w{w}-plane{j}": (((1 << w) - 1) << (w * j), 0) for w in (1, 2, 4) for j in range(8 // w)}}


def _words(rng: np.random.Generator, n: int) -> list[int]:
    exhaustive = [b * 0x01010101 for b in range(256)]  # every byte value in every lane
    return exhaustive + [int(w) for w in rng.integers(0, 2**32, n, dtype=np.uint64)]


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_magic_asm_equals_the_plain_twin(case):
    mask, flip = CASES[case]
    rng = np.random.default_rng(0)
    for word in _words(rng, 200):
        got = run_ptx(MAGIC_ASM.value, {"$2": word, "$3": mask * 0x01010101, "$4": flip * 0x01010101})
        halves = [plain(word >> (8 * i) & 0xFF, mask, flip) for i in range(4)]
        assert got["$0"] == halves[0] | halves[1] << 16 and got["$1"] == halves[2] | halves[3] << 16, hex(word)


def test_masks_may_differ_per_lane():
    """A token's field position differs per token (lane): the PTX takes four masks in one register."""
    masks, word = [0x01, 0x02, 0x0C, 0xF0], 0xFFFFFFFF
    got = run_ptx(MAGIC_ASM.value, {"$2": word, "$3": sum(m << (8 * i) for i, m in enumerate(masks)), "$4": 0})
    halves = [plain(0xFF, m, 0) for m in masks]
    assert (got["$0"], got["$1"]) == (halves[0] | halves[1] << 16, halves[2] | halves[3] << 16)


def test_emulator_knows_the_instructions():
    # lop3 0x6a is (a & b) ^ c; prmt 0x5140 interleaves bytes 0 and 1 of a with bytes of b
    assert _lop3(0xF0F0F0F0, 0xFF00FF00, 0x0F0F0F0F, 0x6A) == (0xF0F0F0F0 & 0xFF00FF00) ^ 0x0F0F0F0F
    assert _prmt(0x44332211, 0x88776655, 0x5140) == 0x66225511
    assert _prmt(0x000080FF, 0, 0x4498) == 0xFFFF  # sign replication of bytes 0, 1; bytes 2, 3 from b
    assert re.search(r"lop3\.b32.*0x6a", MAGIC_ASM.value)


def test_exact_int8_asm_gives_the_signed_code():
    """``MAGIC_SUB_ASM`` with the operands the 8-bit key path passes (mask 0xff, flip 0x80, offset 1024 + 128 in every
    fp16 lane): each byte of an int8 code becomes its signed value in fp16, exactly."""
    offset = int(np.array([1024.0 + 128], dtype=np.float16).view(np.uint16)[0]) * 0x00010001
    for b in range(256):
        got = run_ptx(MAGIC_SUB_ASM.value, {"$2": b * 0x01010101, "$3": 0xFFFFFFFF, "$4": 0x80808080, "$5": offset,
                                             "$6": offset})
        signed = b - 256 if b >= 128 else b
        assert list(_halves(got["$0"])) + list(_halves(got["$1"])) == [signed] * 4, b


def joined_plain(low: int, high: int, s0: int, s1: int, w0: int, w1: int) -> int:
    """The plain twin of ``_joined_operand`` for one byte of each plane set, as fp16 bits: the low set's field at bit
    ``s0`` below the high set's field at bit ``s1``, under 0x6400."""
    return 0x6400 | (low >> s0 & (1 << w0) - 1) | (high >> s1 & (1 << w1) - 1) << w0


# (W0, W1) of the codes stored as two plane sets: 3 = 2 + 1 (int3 keys, 3-bit values), 5 = 4 + 1, 6 = 4 + 2 (6-bit
# values); every field position of each set
JOINS = [(w0, w1, s0, s1) for w0, w1 in ((2, 1), (4, 1), (4, 2))
         for s0 in range(0, 8, w0) for s1 in range(0, 8, w1)]


@pytest.mark.parametrize("w0, w1, s0, s1", JOINS)
def test_join_asm_equals_the_plain_twin(w0, w1, s0, s1):
    """The operands as ``_joined_operand`` passes them for a group of four bytes of one token: the rotations
    (``s0``, ``(s1 - W0) mod 32``), the low field's mask and the code's mask, each byte replicated in the four lanes."""
    rng = np.random.default_rng(s0 * 8 + s1)
    lows, highs = _words(rng, 60), _words(rng, 60)[::-1]
    rotations = {"$4": s0 * 0x01010101, "$5": ((s1 - w0) & 31) * 0x01010101,
                 "$6": ((1 << w0) - 1) * 0x01010101, "$7": ((1 << (w0 + w1)) - 1) * 0x01010101}
    for low, high in zip(lows, highs):
        got = run_ptx(JOIN_ASM.value, {"$2": low, "$3": high, **rotations})
        halves = [joined_plain(low >> (8 * i) & 0xFF, high >> (8 * i) & 0xFF, s0, s1, w0, w1) for i in range(4)]
        assert got["$0"] == halves[0] | halves[1] << 16 and got["$1"] == halves[2] | halves[3] << 16, (hex(low),
                                                                                                      hex(high))


def test_join_asm_rotates_by_the_first_lane():
    """The rotation is the first byte's for all four (mod 32 drops the other lanes' bytes): four bytes of different
    tokens, with different field positions, would be read at the first one's. ``_joined_operand`` relies on the four
    being one token's (``sass.joined_groups_by_token``)."""
    got = run_ptx(JOIN_ASM.value, {"$2": 0x30303003, "$3": 0, "$4": 0x04040400, "$5": 0, "$6": 0x0F0F0F0F,
                                   "$7": 0x3F3F3F3F})
    assert got["$0"] & 0xFF == 0x03 and got["$0"] >> 16 & 0xFF == 0x00  # byte 1 read at rotation 0, not 4
