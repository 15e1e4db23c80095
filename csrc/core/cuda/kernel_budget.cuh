// What each kernel may cost in resources, declared beside its launch code and checked on every
// compiled instance by tools/kernel_report.py (which reads these declarations from the sources
// and the resources from the SASS nvcc emitted; docs/kernel_report.md holds its table).
//
//   JF_KERNEL_BUDGET("regex", max_registers, min_occupancy_percent, max_local_bytes)
//     every instance whose short name (the report's first column) matches the regex (Python
//     re.search) holds at most max_registers registers per thread, reaches at least
//     min_occupancy_percent theoretical occupancy (the H100 for sm_90 code, the A100 for sm_80,
//     at the block size of its __launch_bounds__), and moves at most max_local_bytes bytes
//     through local memory (spills and stack arrays, as counted in its SASS). Each instance
//     must match exactly one budget.
//   JF_KERNEL_GAP("regex", max_registers, min_occupancy_percent, max_local_bytes, "reason")
//     a known gap: in each limit where it is looser than the budget, the instances it matches
//     may go as far as the gap allows; the report prints them as gaps with the reason (the open
//     issue that closes them), never as passing. A gap that excuses no instance fails the
//     report: delete it when its issue closes it.
//
//   JF_KERNEL_LOADS("regex", min_arrays)
//     every instance it matches issues loads from at least min_arrays arrays (distinct address
//     registers) in one straight run of its SASS before any of them is read: the loads of a
//     group go out together rather than one round trip after another.
//
//   JF_KERNEL_RING("regex", slots_sm90, slots_sm80, slot_bytes, slab_bytes)
//     every instance it matches streams data through a ring of dynamic shared memory (cp.async)
//     of slots_sm90 / slots_sm80 slots of slot_bytes on an H100 / A100, slots - 1 slabs of
//     slab_bytes in flight. Its occupancy counts the ring's bytes with the static shared memory,
//     and its ring must keep at least Little's law's bytes in flight per SM.
//
//   JF_KERNEL_IN_FLIGHT("regex", min_times_little)
//     every instance it matches keeps at least min_times_little times Little's law's bytes in
//     flight per SM (the report's GPU for its architecture): its ring's slabs in flight, or
//     without a ring its deepest run of loads, over the blocks its occupancy puts on an SM.
//
// Any unguarded trap fails the report whatever the budget says: a trap in the SASS is nvcc's
// verdict of undefined behaviour on that path (the grid-sync guards of cooperative groups,
// compiled from CUDA's own headers and skipped by a branch, are the only traps allowed), and
// so does a kernel without __launch_bounds__ (the report takes the block size from it).
#pragma once

#define JF_KERNEL_BUDGET(instances, max_registers, min_occupancy_percent, max_local_bytes) \
  static_assert((max_registers) > 0 && (max_registers) <= 255 &&                          \
                    (min_occupancy_percent) >= 0 && (min_occupancy_percent) <= 100 &&     \
                    (max_local_bytes) >= 0,                                                \
                "kernel budget out of range: " instances)

#define JF_KERNEL_RING(instances, slots_sm90, slots_sm80, slot_bytes, slab_bytes)           \
  static_assert((slots_sm90) >= 2 && (slots_sm80) >= 2 && (slab_bytes) > 0 &&              \
                    (slab_bytes) <= (slot_bytes),                                          \
                "ring out of range: " instances)

#define JF_KERNEL_LOADS(instances, min_arrays)                            \
  static_assert((min_arrays) > 0, "loads floor out of range: " instances)

#define JF_KERNEL_IN_FLIGHT(instances, min_times_little)                            \
  static_assert((min_times_little) > 0, "in-flight floor out of range: " instances)

#define JF_KERNEL_GAP(instances, max_registers, min_occupancy_percent, max_local_bytes, reason) \
  static_assert((max_registers) > 0 && (max_registers) <= 255 &&                               \
                    (min_occupancy_percent) >= 0 && (min_occupancy_percent) <= 100 &&          \
                    (max_local_bytes) >= 0 && sizeof(reason) > 1,                              \
                "known gap out of range or without a reason: " instances)
