"""The compiled decode kernels read without a GPU: compile a launch for a CUDA card, disassemble it, count what its
main loop issues (``scripts/kernel_report.py``, and the CI guards in ``tests/kernels/test_kernel_report.py``).

Triton compiles for any CUDA target on a CPU-only machine: its JIT asks the active driver only for the target, so a
stub driver that answers ``("cuda", capability)`` (:func:`cuda_target`) makes ``kernel.warmup(...)`` compile exactly
what a launch with the same arguments would compile on that card (capability 90 is compiled as ``sm_90a``). The
wheel ships NVIDIA's ``cuobjdump``: the SASS (:func:`disassemble`) and the resource usage (registers, local memory,
static shared memory). A loop is the body of a backward branch; the one counted is the tile loop over the quantized
region (:func:`code_loop`), not the exact segments' loops, which can be as long.

Imports Triton when called, nothing else of the package. Kernels must have been defined without
``TRITON_INTERPRET=1`` (the report runs in a process of its own).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ARCHES", "CLASSES", "SHARED_LIMIT_BYTES", "CompiledStats", "classify", "compile_launch", "cuda_target",
           "code_loop", "code_loop_lines", "disassemble", "instructions", "joined_groups_by_token", "joined_ops",
           "line_table", "loops", "main_loop", "REGISTER_CAP", "resource", "stats"]

ARCHES = {"sm_90a": 90, "sm_89": 89, "sm_80": 80}
"""Targets of the report: H100/H200, RTX 4090/L40, A100."""
SHARED_LIMIT_BYTES = {90: 227 * 1024, 89: 99 * 1024, 80: 163 * 1024}
"""Shared memory one block may use (opt-in maximum, CUDA C++ Programming Guide, "Technical Specifications per
Compute Capability"); a launch asking more fails."""
REGISTER_CAP = 255
"""Registers one thread may use on every target here: a kernel at the cap spills or is about to."""
CLASSES = ("global", "conversion", "integer", "float", "mma", "shared_sync", "other")

# SASS opcodes by class (the opcode before its first '.'; uniform-datapath forms, U + opcode, count as their class)
_CLASS_OF = {
    "global": "LDG STG LDGSTS LD ST ATOM ATOMG RED UTMALDG UTMASTG UBLKCP",
    "conversion": "I2F F2I F2F I2FP F2FP I2I I2IP F2IP FRND",
    "integer": ("IADD3 IADD IADD32I IMAD IMUL IMNMX IABS LOP3 LOP LOP32I SHF SHL SHR LEA PRMT ISETP SEL POPC FLO "
                "BREV BMSK SGXT VIADD VIADDMNMX VIMNMX IDP IDP4A BFE BFI ISCADD XMAD"),
    "float": ("FADD FADD32I FMUL FMUL32I FFMA FFMA32I FMNMX FSETP FSET FSEL MUFU FCHK FSWZADD HADD2 HMUL2 HFMA2 "
              "HMNMX2 HSETP2 HSET2 DADD DMUL DFMA"),
    "mma": "HMMA IMMA HGMMA IGMMA QGMMA BMMA DMMA",
    "shared_sync": "LDS LDSM STS STSM ATOMS BAR SHFL DEPBAR LDGDEPBAR MEMBAR SYNCS ARRIVES WARPSYNC FENCE",
}
_OPCODE_CLASS = {op: kind for kind, ops in _CLASS_OF.items() for op in ops.split()}
_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_SOURCE = re.compile(r'//## File "([^"]+)", line (\d+)')
_BRANCH = re.compile(r"^(?:@!?U?P\w+\s+)?BRA(?:\.\S+)?\s+(?:.*,\s*)?0x([0-9a-f]+)")


def _opcode(instruction: str) -> str:
    """The opcode of one SASS instruction without its predicate and modifiers (``"@P0 LDG.E.128 ..."``: ``LDG``)."""
    opcode = instruction.split()[1] if instruction.startswith("@") else instruction.split()[0]
    return opcode.split(".")[0]


def classify(instruction: str) -> str:
    """The class (one of :data:`CLASSES`) of one SASS instruction, e.g. ``"@P0 LDG.E.128 R4, desc[UR4][R2.64]"``."""
    base = _opcode(instruction)
    kind = _OPCODE_CLASS.get(base)
    if kind is None and base.startswith("U"):
        kind = _OPCODE_CLASS.get(base[1:])
    return kind or "other"


@contextlib.contextmanager
def cuda_target(capability: int) -> Iterator[None]:
    """Within the block, Triton's JIT compiles for CUDA compute capability ``capability`` (the active driver is a
    stub that answers that target and a device id of its own, so that each target keeps its own compiled kernels)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class StubDriver:
        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self):
            return f"report-sm{capability}"

        def get_current_stream(self, device=None):
            return 0

    try:
        previous = driver.active
    except RuntimeError:  # no GPU driver here (the usual case): nothing to restore
        previous = None
    driver.set_active(StubDriver())
    try:
        yield
    finally:
        if previous is not None:
            driver.set_active(previous)


def compile_launch(kernel, grid, args, options):
    """Compile ``kernel[grid](*args, **options)`` for the current target (see :func:`cuda_target`) without launching:
    Triton's ``CompiledKernel`` (``.asm["cubin"]``, ``.metadata``)."""
    return kernel.warmup(*args, grid=grid, **options)


def _read_cubin(cubin: bytes, tool: str, *flags: str) -> str:
    """The output of the triton wheel's NVIDIA ``tool`` (``"cuobjdump"``, ``"nvdisasm"``) run on ``cubin``."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([getattr(knobs.nvidia, tool).path, *flags, str(path)], capture_output=True, text=True,
                              check=True)
    return done.stdout


def _cuobjdump(cubin: bytes, flag: str) -> str:
    return _read_cubin(cubin, "cuobjdump", flag)


def disassemble(cubin: bytes) -> str:
    """The SASS of a cubin (``cuobjdump -sass``)."""
    return _cuobjdump(cubin, "-sass")


def instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of every instruction of a disassembly, in address order."""
    found = []
    for line in sass.splitlines():
        match = _LINE.match(line)
        if match:
            found.append((int(match.group(1), 16), match.group(2)))
    return found


def _spans(sass: str) -> list[tuple[int, int, list[str]]]:
    """``(first address, branch address, instructions)`` of every loop, in address order of the branches."""
    listing = instructions(sass)
    found = []
    for address, text in listing:
        match = _BRANCH.match(text)
        if match and int(match.group(1), 16) <= address:
            start = int(match.group(1), 16)
            found.append((start, address, [t for a, t in listing if start <= a <= address]))
    return found


def loops(sass: str) -> list[list[str]]:
    """The instructions of every loop: from the target of a backward branch to the branch itself, in address order
    of the branches (an inner loop is also inside its outer one)."""
    return [body for _, _, body in _spans(sass)]


def main_loop(sass: str) -> list[str]:
    """The instructions of the largest loop (an inner loop is counted once). Empty when the kernel has no loop."""
    return max(loops(sass), key=len, default=[])


def _code_span(sass: str) -> tuple[int, int, list[str]] | None:
    found = [(sum(1 for text in span[2] if _opcode(text) == "PRMT"), span) for span in _spans(sass)]
    if not found:
        return None
    permutes, best = max(found, key=lambda pair: (pair[0], len(pair[1][2])))
    return best if permutes else max((span for _, span in found), key=lambda span: len(span[2]))


def code_loop(sass: str) -> list[str]:
    """The tile loop over stored codes: the loop with the most ``PRMT`` (the byte permutes of the magic-number
    conversion, which every fast-path format issues and the exact segments' loops do not), the largest of those
    tied; :func:`main_loop` when no loop has one (the generic path unpacks with shifts)."""
    span = _code_span(sass)
    return [] if span is None else span[2]


def line_table(listing: str) -> dict[int, tuple[str, int]]:
    """Address -> ``(file name, line)`` of the source line each instruction was compiled from, read from an
    ``nvdisasm -g`` listing (its ``//## File "...", line N`` notes precede the instructions they cover; Triton
    writes the line table into every cubin). Instructions before the first note are left out."""
    table, where = {}, None
    for line in listing.splitlines():
        note = _SOURCE.search(line)
        if note:
            where = (Path(note.group(1)).name, int(note.group(2)))
            continue
        match = _LINE.match(line)
        if match and where is not None:
            table[int(match.group(1), 16)] = where
    return table


def code_loop_lines(cubin: bytes) -> dict[tuple[str, int], Counter]:
    """The instructions of :func:`code_loop` by the source line they come from: ``(file name, line)`` -> opcode
    counts, most instructions first (``("?", 0)``: no line recorded). What ``scripts/kernel_report.py --lines``
    prints: where a loop's instructions go, in the kernel's own terms."""
    span = _code_span(disassemble(cubin))  # cuobjdump's listing: branches name their targets by address
    if span is None:
        return {}
    listing = _read_cubin(cubin, "nvdisasm", "-g", "-c")  # the same addresses, with the line notes
    table = line_table(listing)
    counts: dict[tuple[str, int], Counter] = {}
    for address, text in instructions(listing):
        if span[0] <= address <= span[1]:
            counts.setdefault(table.get(address, ("?", 0)), Counter())[_opcode(text)] += 1
    return dict(sorted(counts.items(), key=lambda item: -sum(item[1].values())))


@dataclass(frozen=True)
class CompiledStats:
    """What one compiled kernel uses and issues.

    Attributes:
        registers: per thread; local_bytes: local memory and stack per thread (spills, or arrays the compiler could
            not keep in registers); spill_instructions: local loads and stores (``LDL``/``STL``) anywhere in the kernel;
        shared_bytes: static + dynamic shared memory per block (what a launch asks for);
        num_warps: warps per program; loop: the main loop's instruction count by class (:data:`CLASSES`).
    """

    registers: int
    local_bytes: int
    spill_instructions: int
    shared_bytes: int
    num_warps: int
    loop: dict[str, int]

    @property
    def loop_instructions(self) -> int:
        return sum(self.loop.values())


def resource(usage: str, name: str) -> int:
    """The value of ``NAME:value`` in ``cuobjdump --dump-resource-usage`` output (0 when absent)."""
    match = re.search(rf"\b{name}:(\d+)", usage)
    return int(match.group(1)) if match else 0


_BLOCKED = re.compile(r"^(#\w+) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\].*order = \[([\d, ]+)\]", re.M)


JOIN_MARKER = "shf.r.wrap"
"""What tells :data:`~hf_asymkv.kernels.triton_codes.JOIN_ASM` apart from the other inline PTX in a kernel's TTGIR."""


def joined_ops(ttgir: str, marker: str = JOIN_MARKER) -> int:
    """How many joins of two plane sets (inline PTX with ``marker``) a compiled kernel's TTGIR holds."""
    return sum(1 for line in ttgir.splitlines() if "tt.elementwise_inline_asm" in line and marker in line)


def joined_groups_by_token(ttgir: str, marker: str = JOIN_MARKER) -> list[str]:
    """Problems (empty: none) with the layouts of the inline PTX that joins two plane sets
    (:data:`~hf_asymkv.kernels.triton_codes.JOIN_ASM`, found by ``marker``) in a compiled kernel's TTGIR
    (``compiled.asm["ttgir"]``): the PTX rotates four packed bytes by the first one's amount, so each thread's
    elements must run along the channels (the last axis) in groups of four: a blocked layout, last axis fastest, a
    multiple of 4 elements per thread along it. Anything else (another layout kind, another order) is named."""
    layouts = {name: ([int(v) for v in size.split(",")], [int(v) for v in order.split(",")])
               for name, size, order in _BLOCKED.findall(ttgir)}
    problems = []
    for line in ttgir.splitlines():
        if "tt.elementwise_inline_asm" not in line or marker not in line:
            continue
        for tensor, layout in set(re.findall(r"tensor<([\dx]+)x\w+, (#\w+)>", line)):
            size, order = layouts.get(layout, (None, None))
            rank = tensor.count("x") + 1
            if size is None or order[0] != rank - 1 or size[-1] % 4:
                problems.append(f"joined codes in layout {layout} (sizePerThread {size}, order {order})")
    return sorted(set(problems))


def stats(compiled) -> CompiledStats:
    """:class:`CompiledStats` of a ``CompiledKernel`` (from :func:`compile_launch`)."""
    cubin = compiled.asm["cubin"]
    usage = _cuobjdump(cubin, "--dump-resource-usage")
    sass = disassemble(cubin)
    spills = sum(1 for _, text in instructions(sass) if classify(text) == "other" and re.search(r"\b(LDL|STL)\b", text))
    loop = Counter(classify(text) for text in code_loop(sass))
    return CompiledStats(registers=resource(usage, "REG"),
                         local_bytes=resource(usage, "LOCAL") + resource(usage, "STACK"), spill_instructions=spills,
                         shared_bytes=resource(usage, "SHARED") + int(compiled.metadata.shared),
                         num_warps=int(compiled.metadata.num_warps), loop={kind: loop.get(kind, 0) for kind in CLASSES})
