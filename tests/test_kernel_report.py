"""tools/kernel_report.py's judgement, on made-up instances (CI runs the report itself on the real
CUDA module and on its planted bugs, which need nvcc): occupancy, traps, budgets and gaps."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kernel_report", ROOT / "tools" / "kernel_report.py")
kr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kr)


def instance(name="multi_tensor_kernel<4, ChunkOp<Adam, float, 2 states, plain>>", arch="sm_90",
             registers=60, threads=256, shared=0, sass=(), ring=None, budgets=None, gaps=(),
             floors=()):
  """An instance analysed from `sass`, its occupancy counting `ring`; judged against `budgets`,
  `gaps` and `floors` when `budgets` is given."""
  inst = kr.Instance("mangled", arch, name=name, registers=registers, threads=threads,
                     shared=shared, ring=ring)
  kr.analyse(inst, list(sass))
  inst.occupancy = kr.occupancy(inst)
  if budgets is not None:
    kr.judge(inst, budgets, list(gaps), floors)
  return inst


def instr(opcode, operands="", where=(), predicated=False, subroutine=None):
  """One made-up SASS instruction, as kr.read_sass gives it."""
  return (where, predicated, opcode, subroutine, operands)


def sass_of(*lines):
  """Made-up SASS: (opcode, operands) per instruction."""
  return [instr(*line) for line in lines]


@pytest.mark.parametrize("arch,registers,threads,shared,expected", [
    ("sm_90", 32, 256, 0, 100.0),   # 8 blocks of 8 warps
    ("sm_90", 64, 256, 0, 50.0),    # 65536 / (64 * 32) = 32 warps
    ("sm_90", 72, 256, 0, 37.5),    # 72 * 32 = 2304 per warp: 28 warps, 3 whole blocks
    ("sm_90", 97, 256, 0, 25.0),    # the fp32 Adam kernel of the first GPU run
    ("sm_90", 128, 256, 42292, 25.0),
    ("sm_90", 32, 1024, 0, 100.0),
    ("sm_90", 32, 256, 100_000, 25.0),  # shared memory binds: 2 blocks of 8 warps on an H100
    ("sm_80", 32, 256, 100_000, 12.5),  # an A100 has less shared memory: 1 block
])
def test_occupancy(arch, registers, threads, shared, expected):
  assert instance(arch=arch, registers=registers, threads=threads,
                  shared=shared).occupancy == expected


RING_BUDGET = [kr.Budget("^k<", 128, 25, 0)]


def ring(slab=16384, h100_slots=4):
  """A ring of 16 KB slots (2 on an A100) whose copies fill `slab` bytes."""
  return kr.Ring("^k<", {"sm_90": h100_slots, "sm_80": 2}, 16384, slab)


def ring_kernel(arch="sm_90", slab=16384, h100_slots=4, sass=(), floors=()):
  """k<bf16> (128 registers, 43376 B of static shared memory) with ring(slab, h100_slots), its
  occupancy counting the ring, judged against RING_BUDGET and `floors`."""
  return instance(name="k<bf16>", arch=arch, registers=128, shared=43376, sass=sass,
                  ring=ring(slab, h100_slots), budgets=RING_BUDGET, floors=floors)


def test_a_ring_counts_in_occupancy_and_must_cover_littles_law():
  assert ring_kernel().occupancy == 25.0  # 2 blocks of 43376 + 65536 bytes fit 228 KB
  assert ring_kernel(h100_slots=5).occupancy == 12.5  # 5 slots do not
  small = ring_kernel(arch="sm_80", slab=4096)  # 1 x 4 KB x 2 blocks
  assert "its ring keeps 8 KB an SM in flight, below Little's law's 11 KB" in small.status
  assert kr.in_flight(ring_kernel()) == "0, 0 B; ring 3 x 16 KB: 96 KB/SM (5.5x)"
  copies = instance(sass=sass_of(("LDGSTS.E.BYPASS.LTC128B.128", "[R3], desc[UR4][R4.64]"),
                                 ("LDGSTS.E.BYPASS.LTC128B.128", "[R3+0x10], desc[UR4][R6.64]")))
  assert (copies.async_copies, copies.loads) == (2, {})


def test_an_in_flight_floor_counts_the_ring_or_the_loads():
  """JF_KERNEL_IN_FLIGHT: the ring's slabs in flight per SM, or without a ring the deepest run of
  loads over the SM's resident threads, against a multiple of Little's law."""
  floor = [kr.InFlightFloor("^k<", 2.0, where="x.cu:1")]
  loop = slab_loop_sass(["LDS.128"] * 60)
  assert ring_kernel(sass=loop, floors=floor).status == "ok"  # 3 x 16 KB x 2 blocks: 5.5x
  short = ring_kernel(arch="sm_80", slab=8192, sass=loop, floors=floor)  # 1 x 8 KB x 2 blocks
  assert "16 KB an SM in flight (1.4x Little's law) < 2x (x.cu:1)" in short.status
  loads = instance(name="k<f32>", registers=128, sass=sass_of(
      ("LDG.E.128", "R4, desc[UR4][R2.64]"), ("LDG.E.128", "R8, desc[UR4][R12.64]"),
      ("FADD", "R0, R4, R8")), budgets=RING_BUDGET, floors=floor)
  # 32 B x 512 threads an SM: 16 KB, 0.9x
  assert "16 KB an SM in flight (0.9x Little's law) < 2x" in loads.status


def slab_loop_sass(body):
  """A ring loop: the wait for its copies, `body` (opcodes), the mmas, the branch back."""
  return sass_of(("DEPBAR.LE", "SB0, 0x2"), *[(op,) for op in body], ("HMMA.16816.F32.BF16",),
                 ("BRA",))


def test_a_ring_loop_must_issue_its_slabs_faster_than_hbm_delivers_them():
  # 8 warps, 4 schedulers: a slab of 16 KB each 2 x cycles / 1.98 GHz; the H100's share of HBM
  # is 25.4 GB/s an SM.
  lean = ring_kernel(sass=slab_loop_sass(["LDS.128"] * 60 + ["LOP3.LUT"] * 50 + ["IMAD"] * 40))
  assert [(loop.instructions, loop.cycles) for loop in lean.slab_loops] == [(153, 153)]
  converting = ring_kernel(sass=slab_loop_sass(["I2F.S8"] * 64 + ["LOP3.LUT"] * 300))
  assert converting.slab_loops[0].cycles == 600  # its ALU ops bind, then its conversions (512)
  assert lean.status == "ok"
  assert "slab loop 153 instr, 153 cycles: 106 GB/s an SM (4.2x HBM)" in kr.in_flight(lean)
  assert ("its slab loop issues 27 GB/s an SM, 1.1x the SM's share of HBM < 1.5x"
          in converting.status)
  outside = instance(sass=sass_of(("DEPBAR.LE", "SB0, 0x0"), ("BRA",)))
  assert outside.slab_loops == []  # no mma before the branch: not a slab loop
  outside.ring = ring()
  kr.judge(outside, [kr.Budget(r"\bChunkOp<", 128, 25, 0)], [])
  assert "no slab loop found in its SASS" in outside.status


CG, DECODER = "/cuda/include/cooperative_groups.h", "/x/csrc/decoder/cuda/decoder.cu"
GRID_SYNC_GUARD = [instr("BRA", where=((CG, 179), (DECODER, 56)), predicated=True),
                   instr("BPT.TRAP", where=((CG, 180), (DECODER, 56)))]
SHARED_GRID_SYNC_GUARD = [  # several syncs jump to one failure block after the kernel's EXIT
    instr("EXIT", where=((DECODER, 80),)), instr("BPT.TRAP", where=((CG, 180), (DECODER, 65)))]
STRAIGHT_LINE_TRAP = [  # reached by falling through: not a guard, wherever it is
    instr("IADD3", where=((CG, 180),)), instr("BPT.TRAP", where=((CG, 180),))]
HOST_READ_AT = (("/x/csrc/optim/optimizer.h", 83), ("/x/csrc/optim/cuda/multi_tensor.cuh", 101))
HOST_OBJECT_READ = [instr("BRA", where=HOST_READ_AT, predicated=True),
                    instr("BPT.TRAP", where=HOST_READ_AT)]


def test_traps_and_accesses_are_read_from_the_sass():
  inst = instance(sass=[
      instr("LDG.E.128"), instr("LDG.E.64", predicated=True), instr("STG.E"), instr("STL.64"),
      instr("LDL"), instr("STL.128", subroutine="__cuda_sm3x_div_rn_noftz_f32_slowpath"),
      *GRID_SYNC_GUARD])
  assert inst.loads == {128: 1, 64: 1} and inst.stores == {32: 1}
  assert (inst.local_stores, inst.local_loads, inst.slow_path_local) == (8, 4, 16)
  assert inst.local_instructions == 2
  assert [guarded for guarded, _ in inst.traps] == [True]
  assert [guarded for guarded, _ in instance(sass=HOST_OBJECT_READ).traps] == [False]
  assert [guarded for guarded, _ in instance(sass=SHARED_GRID_SYNC_GUARD).traps] == [True]
  assert [guarded for guarded, _ in instance(sass=STRAIGHT_LINE_TRAP).traps] == [False]


def test_budgets_gaps_and_failures():
  budgets = [kr.Budget(r"\bChunkOp<", 64, 50, 0, where="here")]
  assert instance(registers=60, budgets=budgets).status == "ok"
  heavy = instance(registers=97, budgets=budgets)  # 25% occupancy, over 64 registers
  assert heavy.status.startswith("FAIL") and "97 registers > 64" in heavy.status

  gap = kr.Budget(r"\bChunkOp<\w+, float", 120, 25, 0, reason="issue 39", where="here")
  heavy = instance(registers=97, budgets=budgets, gaps=[gap])
  assert heavy.status.startswith("gap") and "issue 39" in heavy.status
  assert gap.excused == {(heavy.name, "sm_90")}
  # The gap allows no spills.
  spilling = instance(registers=97, sass=[instr("STL")], budgets=budgets, gaps=[gap])
  assert "local memory 4+0 B > 0 B (beyond its known gaps)" in spilling.status
  trapped = instance(registers=60, sass=HOST_OBJECT_READ, budgets=budgets, gaps=[gap])
  assert "unguarded trap at optimizer.h:83 in multi_tensor.cuh:101" in trapped.status

  assert instance(registers=60, sass=GRID_SYNC_GUARD, budgets=budgets).status == "ok"
  orphan = instance(name="multi_tensor_kernel<1, NormChunkOp>", budgets=budgets)
  assert "matches 0 JF_KERNEL_BUDGET declarations" in orphan.status
  assert "no __launch_bounds__" in instance(threads=0, budgets=budgets).status


def test_budgets_are_read_from_the_sources(tmp_path):
  budgets, gaps, floors = kr.read_budgets(kr.budget_sources("module.so"))
  fixed = [b for b in budgets
           if b.pattern.startswith(r"\bChunkOp<") and b.pattern.endswith("params")]
  assert fixed and fixed[0].max_registers == 64 and fixed[0].min_occupancy == 50
  decoder = [b for b in budgets if b.pattern == "^decoder_kernel<"]
  assert decoder and decoder[0].max_local_bytes == 32
  assert all(g.reason for g in gaps)
  source = tmp_path / "gap.cu"  # no source declares a gap today: read a made-up one
  source.write_text('JF_KERNEL_GAP("^k<", 96, 25, 64,\n              "issue 1: why");\n')
  _, (gap,), _ = kr.read_budgets([str(source)])
  assert (gap.pattern, gap.max_registers, gap.max_local_bytes, gap.reason) == (
      "^k<", 96, 64, "issue 1: why")


def test_loads_in_flight_counts_arrays_loaded_before_any_is_read():
  together = sass_of(("LDG.E.128", "R4, desc[UR6][R2.64]"), ("LDG.E.128", "R8, desc[UR6][R12.64]"),
                     ("LDG.E.128", "R16, desc[UR6][R2.64+0x1000]"),  # R2's array again
                     ("FADD", "R20, R4, R8"), ("LDG.E.64", "R22, desc[UR6][R14.64]"))
  assert instance(sass=together).loads_in_flight == 2
  # 48 bytes a thread before the FADD; at 60 registers (50%: 1024 threads an H100 SM) 48 KB,
  # 2.8x the ~17 KB Little's law asks of an SM
  assert kr.in_flight(instance(sass=together)) == "2, 48 B, 48 KB/SM (2.8x)"
  serial = sass_of(("LDG.E.128", "R4, desc[UR6][R2.64]"), ("FSETP.GT.AND", "P0, PT, R4, RZ, PT"),
                   ("LDG.E.128", "R8, desc[UR6][R12.64]"))
  inst = instance(sass=serial, budgets=[kr.Budget(r"ChunkOp<", 64, 50, 0)],
                  floors=[kr.LoadsFloor(r"ChunkOp<", 2)])
  assert (inst.loads_in_flight, inst.bytes_in_flight) == (1, 16)
  assert "1 arrays loaded in flight < 2" in inst.status
  branch = sass_of(("LDG.E.128", "R4, desc[UR6][R2.64]"), ("BRA", "0x100"),
                   ("LDG.E.128", "R8, desc[UR6][R12.64]"))
  assert instance(sass=branch).loads_in_flight == 1
