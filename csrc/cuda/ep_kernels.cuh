// The dispatch/combine kernels and their launchers, written once for two builds: nvcc
// (ep_kernels.cu, the `_cuda` module that runs on GPUs) and a host compiler with the block/warp
// emulator of cuda/sim_device.h (sim.cpp, the `_cuda_sim` module that CI runs on every machine).
// cuda/device.h supplies what differs between them: the launch, the PTX memory-model helpers,
// the global timer and dynamic shared memory.
//
// Device kernels of the one-sided protocol (docs/protocol.md) over CUDA IPC mappings.
//
// Every rank owns one region in device memory; peers map it with cudaIpcOpenMemHandle (on one GPU
// between processes, or over NVLink between GPUs), and the table `peer_bases[R]` (device memory)
// holds each region's address as mapped here (this rank's own region included). A sender writes
// rows straight into the receiver's region, makes them visible at system scope, then stores the
// signal `(tag << 32) | count` with release semantics at system scope; the receiver loads it with
// acquire semantics and accepts only its own call's tag. Same region layout, same signals, same
// packing rules and the same arithmetic (common/numerics.h) as the CPU transports, so outputs are
// bit-identical to the shm transport's.
//
// The call number lives on the device: the first kernel of a dispatch writes it into the
// dispatch's call word, which every later kernel of that dispatch and of its combine reads: the
// host's number for eager calls, `max(counter + 1, host_call)` once a graph was captured
// (advance_call: k_advance_call, or block E of the fused k_dispatch_prepare). A captured CUDA graph
// therefore uses a new tag on every replay (stale signals of an earlier replay never match), while
// the region half stays the one chosen at capture (one dispatch and its combine strictly alternate per rank, which
// is what makes reusing a half safe, docs/protocol.md).
//
// Waits are bounded on the device: each receive waits per source up to timeout_us on the GPU's
// global timer; on expiry it writes 0 into the caller's active_ranks, flags the source in the
// mapped control words (the host reads them as failed_sources) and treats the source as having
// sent nothing. The control block's abort word (raised by destroy()) ends every wait at once, and
// the peer watcher's dead words (host memory mapped into the device) end a wait on a source whose
// process is known to have ended.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/numerics.h"
#include "cuda/api.h"
#include "cuda/device.h"

namespace mep_cuda {
namespace {

using mep::bf16_amax_from_bits;
using mep::bf16_to_float;
using mep::call_tag;
using mep::float_to_bf16;
using mep::float_to_e4m3fn;
using mep::fp8_group_scale;
using mep::make_signal;
using mep::signal_count;
using mep::signal_tag;

constexpr int kThreads = 256;  // threads of a copy block (8 warps)
constexpr int kWarps = kThreads / 32;
constexpr int kScaleGroup = 128;
constexpr int64_t kScratchAlign = 256;

// ---------------------------------------------------------------------------------------------
// Memory-model helpers: store_release_sys, load_acquire_sys, global_timer_ns, dynamic_shared
// (cuda/device.h: PTX under nvcc, the emulator's versions in the host build)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ bool aborted(const Call& call) {
    return reinterpret_cast<const volatile int32_t*>(call.control)[0] != 0;
}

__device__ __forceinline__ uint8_t* half_base(const Call& call, const Region& region, int32_t peer) {
    const uint64_t base = reinterpret_cast<const uint64_t*>(call.peer_bases)[peer];
    if (base == 0) return nullptr;
    return reinterpret_cast<uint8_t*>(base) + region.control_bytes + int64_t(call.half_index) * region.half_bytes;
}

__device__ __forceinline__ int32_t is_active(const Call& call, int32_t peer) {
    return reinterpret_cast<const volatile int32_t*>(call.active)[peer];
}

// A destination the send kernels write: active in the caller's mask, reachable, and not known dead
// (the peer watcher's word: writing into the region of a process that has ended is never needed, and
// its memory may already be gone). Read live once per send phase by k_snapshot_writable into the
// call word's snapshot, which the row and signal kernels then read from device memory: the dead
// words live in mapped host memory, and on an H100 each warp's read of them cost about 1 us, one
// after another across the grid (1 ms for the 1024 warps of an R=2 T=128 K=8 dispatch).
__device__ __forceinline__ bool writable_now(const Call& call, int32_t peer) {
    if (!is_active(call, peer)) return false;
    if (reinterpret_cast<const uint64_t*>(call.peer_bases)[peer] == 0) return false;
    return call.dead == 0 || reinterpret_cast<const volatile int32_t*>(call.dead)[peer] == 0;
}

// The call word (call_word_size(R) int64): [0] the call number, [1 + r] whether peer r is writable in this
// send phase, [1 + R + i] the arrival count of the fused kernel i (kArrive*, below).
__device__ __forceinline__ int64_t* writable_snapshot(const Call& call) {
    return reinterpret_cast<int64_t*>(call.call_word) + 1;
}

// The fused kernels (Call::fused): each block of a grid arrives once it has done its part, and the block
// that arrives last also does the step that needed the whole grid done (the signals after the rows, the
// layout after the waits), which the split launches run as a kernel of their own.
constexpr int kArriveDispatchRows = 0, kArriveDispatchWait = 1, kArriveCombineRows = 2, kArrivals = 3;

__device__ __forceinline__ unsigned* arrivals(const Call& call, int which) {
    return reinterpret_cast<unsigned*>(reinterpret_cast<int64_t*>(call.call_word) + 1 + call.num_ranks + which);
}

// Every thread of every block of the grid calls it once, after the block's work: true in every thread of
// the block that arrived last, which then sees (device scope) every write the grid's blocks made before they
// arrived (their threads met at the barrier, then one thread fenced and counted), and has reset the count
// for the next launch (every other block has counted). The row kernels fence at system scope before it
// (block_fence_system); with `release_sys` the last block's counting thread then fences at system scope
// before its threads meet, so the rows of every block are ordered before the release stores of the
// signals that the last block's threads make next (one system fence in that block, not one per thread).
__device__ __forceinline__ bool arrived_last(unsigned* count, bool release_sys) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
        last = atomicAdd(count, 1u) == blocks - 1 ? 1 : 0;
        if (last) {
            atomicExch(count, 0u);
            if (release_sys) __threadfence_system();
            else __threadfence();
        }
    }
    __syncthreads();
    return last != 0;
}

__device__ __forceinline__ bool writable(const Call& call, int32_t peer) {
    return writable_snapshot(call)[peer] != 0;
}

// Every thread: the snapshot of writable_now for its peers (one block, launched first in a send phase).
__device__ __forceinline__ void snapshot_writable(const Call& call) {
    for (int32_t peer = threadIdx.x; peer < call.num_ranks; peer += blockDim.x)
        writable_snapshot(call)[peer] = writable_now(call, peer) ? 1 : 0;
}

// The end of a kernel that wrote rows into peers' regions: the block's threads meet at a barrier, then
// one thread fences at system scope, so every row the block wrote is ordered (by the fence's
// cumulativity) before the signals stored with release semantics after it: by a later kernel of the
// stream (split launches), or by the grid's last block once this block arrived (fused launches). One
// fence per block, not per thread: on an H100 a system-scope fence cost about 1 us per warp and the
// fences of a grid ran one after another (1 ms for the 1024 warps of an R=2 T=128 K=8 dispatch).
__device__ __forceinline__ void block_fence_system() {
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
}

// A warp copies `nbytes` (a multiple of 16) from src to dst (never overlapping: a row between two
// regions): 16-byte accesses when both are 16-byte aligned, four of a lane's loads issued before its
// stores (the compiler cannot hoist a load above a store that may alias it, so a plain loop has one
// load in flight: a row of a peer's memory was read at one access per round trip); else 2-byte ones
// (rows are bf16 or FP8 with even sizes).
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, int64_t nbytes, int lane) {
    if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
        const int64_t n = nbytes / 16;
        auto* d = reinterpret_cast<int4*>(dst);
        const auto* s = reinterpret_cast<const int4*>(src);
        int64_t i = lane;
        for (; i + 96 < n; i += 128) {
            const int4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
            d[i] = a;
            d[i + 32] = b;
            d[i + 64] = c;
            d[i + 96] = e;
        }
        for (; i < n; i += 32) d[i] = s[i];
    } else {
        const int64_t n = nbytes / 2;
        auto* d = reinterpret_cast<uint16_t*>(dst);
        const auto* s = reinterpret_cast<const uint16_t*>(src);
        for (int64_t i = lane; i < n; i += 32) d[i] = s[i];
    }
}

// The warps that copy one row between them (Call::row_warps; 0 = 1).
__host__ __device__ __forceinline__ int32_t row_warps(const Call& call) {
    return call.row_warps > 0 ? call.row_warps : 1;
}

// Part `part` of `parts` of a row of `nbytes`: [offset, offset + bytes), the parts 16-byte multiples but the
// last (so every part starts as aligned as the row does; a part past the row's end is empty).
struct RowPart {
    int64_t offset, bytes;
};

__device__ __forceinline__ RowPart row_part(int64_t nbytes, int32_t part, int32_t parts) {
    const int64_t chunk = (nbytes + int64_t(parts) * 16 - 1) / (int64_t(parts) * 16) * 16;
    const int64_t offset = int64_t(part) * chunk;
    const int64_t left = nbytes - offset;
    return RowPart{offset, left <= 0 ? 0 : (left < chunk ? left : chunk)};
}

// ---------------------------------------------------------------------------------------------
// Scratch of one dispatch shape (two copies, one per region half: at most two dispatches live)
// ---------------------------------------------------------------------------------------------

struct Scratch {
    int32_t* slots;        // [N*K] row index of (token, k) among the tokens selecting that expert
    int32_t* send_counts;  // [E] tokens this rank sends to each expert
    int32_t* recv_counts;  // [R*L] rows received per (source, local expert); 0 for a failed source
    int32_t* recv_begins;  // [R*L] first packed row of each (source, local expert)
    uint8_t* fp8_rows;     // [T*H] this rank's tokens quantized once
    float* fp8_scales;     // [T*G]
};

__host__ __device__ int64_t align_up(int64_t n) { return (n + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

struct ScratchSizes {
    int64_t slots, send_counts, recv_counts, recv_begins, fp8_rows, fp8_scales, half;
};

ScratchSizes scratch_sizes(int32_t R, int32_t T, int32_t H, int32_t E, int32_t K) {
    ScratchSizes s;
    s.slots = align_up(int64_t(T) * K * 4);
    s.send_counts = align_up(int64_t(E) * 4);
    s.recv_counts = align_up(int64_t(E) * 4);
    s.recv_begins = align_up(int64_t(E) * 4);
    s.fp8_rows = align_up(int64_t(T) * H);
    s.fp8_scales = align_up(int64_t(T) * (H / kScaleGroup) * 4);
    s.half = s.slots + s.send_counts + s.recv_counts + s.recv_begins + s.fp8_rows + s.fp8_scales;
    (void)R;
    return s;
}

Scratch carve(uintptr_t base, int32_t half_index, int32_t R, int32_t T, int32_t H, int32_t E, int32_t K) {
    const ScratchSizes s = scratch_sizes(R, T, H, E, K);
    auto* p = reinterpret_cast<uint8_t*>(base) + int64_t(half_index) * s.half;
    Scratch out;
    out.slots = reinterpret_cast<int32_t*>(p);
    p += s.slots;
    out.send_counts = reinterpret_cast<int32_t*>(p);
    p += s.send_counts;
    out.recv_counts = reinterpret_cast<int32_t*>(p);
    p += s.recv_counts;
    out.recv_begins = reinterpret_cast<int32_t*>(p);
    p += s.recv_begins;
    out.fp8_rows = p;
    p += s.fp8_rows;
    out.fp8_scales = reinterpret_cast<float*>(p);
    return out;
}

// ---------------------------------------------------------------------------------------------
// Dispatch, send phase
// ---------------------------------------------------------------------------------------------

// The call number of this dispatch. Eager calls (advance == 0) use the host's number exactly, so
// dispatches issued on two streams keep the host's order whatever order their kernels run in;
// calls that may replay without the host (captured in a CUDA graph, or any call once a graph was
// captured: advance == 1) take max(counter + 1, host_call), a new number at every replay.
__device__ __forceinline__ void advance_call(const Call& call) {
    snapshot_writable(call);
    if (threadIdx.x != 0) return;
    auto* counter = reinterpret_cast<unsigned long long*>(call.counter);
    unsigned long long next = (unsigned long long)call.host_call;
    if (call.advance == 0) {
        atomicMax(counter, next);
    } else {
        unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(counter), old;
        do {
            old = seen;
            next = old + 1 > (unsigned long long)call.host_call ? old + 1 : (unsigned long long)call.host_call;
            seen = atomicCAS(counter, old, next);
        } while (seen != old);
    }
    *reinterpret_cast<uint64_t*>(call.call_word) = next;
}

__global__ void k_advance_call(Call call) { advance_call(call); }

// Block e ranks the tokens that selected expert e, ascending (a block-wide scan of a flag per
// token): slots[t*K + k] = that rank for the k with topk[t][k] == e; send_counts[e] = how many.
__device__ __forceinline__ void rank_tokens(int32_t expert, const int64_t* topk, int32_t num_tokens, int32_t top_k,
                                            const Scratch& scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ int32_t warp_totals[kWarps];
    int32_t running = 0;
    for (int32_t first = 0; first < num_tokens; first += kThreads) {
        const int32_t t = first + threadIdx.x;
        int32_t chosen = -1;
        if (t < num_tokens)
            for (int32_t k = 0; k < top_k; ++k)
                if (topk[int64_t(t) * top_k + k] == expert) {
                    if (chosen < 0) chosen = k;
                    else scratch.slots[int64_t(t) * top_k + k] = -1;  // a repeat: the token goes once
                }
        const unsigned mask = __ballot_sync(0xffffffffu, chosen >= 0);
        if (lane == 0) warp_totals[warp] = __popc(mask);
        __syncthreads();
        int32_t before = 0, total = 0;
        for (int w = 0; w < kWarps; ++w) {
            before += w < warp ? warp_totals[w] : 0;
            total += warp_totals[w];
        }
        if (chosen >= 0)
            scratch.slots[int64_t(t) * top_k + chosen] = running + before + __popc(mask & ((1u << lane) - 1u));
        running += total;
        __syncthreads();
    }
    if (threadIdx.x == 0) scratch.send_counts[expert] = running;
}

__global__ void k_rank_tokens(const int64_t* topk, int32_t num_tokens, int32_t top_k, Scratch scratch) {
    rank_tokens(blockIdx.x, topk, num_tokens, top_k, scratch);
}

// Block t quantizes token t: a warp per 128-channel group (4 channels a lane), amax by the bf16
// magnitude bits, scale and codes by the shared rules of common/numerics.h.
__device__ __forceinline__ void quantize_token(int32_t t, const uint16_t* x, int32_t hidden, const Scratch& scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int32_t groups = hidden / kScaleGroup;
    for (int32_t g = warp; g < groups; g += kWarps) {
        const uint16_t* xg = x + int64_t(t) * hidden + int64_t(g) * kScaleGroup + lane * 4;
        uint16_t v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = xg[i];
        uint32_t m = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) m = max(m, uint32_t(v[i] & 0x7fffu));
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
        const float scale = fp8_group_scale(bf16_amax_from_bits(uint16_t(m)));
        uint32_t packed = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) packed |= uint32_t(float_to_e4m3fn(__fdiv_rn(bf16_to_float(v[i]), scale))) << (8 * i);
        *reinterpret_cast<uint32_t*>(scratch.fp8_rows + int64_t(t) * hidden + int64_t(g) * kScaleGroup + lane * 4) =
            packed;
        if (lane == 0) scratch.fp8_scales[int64_t(t) * groups + g] = scale;
    }
}

__global__ void k_quantize(const uint16_t* x, int32_t hidden, Scratch scratch) {
    quantize_token(blockIdx.x, x, hidden, scratch);
}

// Fused: the first kernel of a send phase. Blocks [0, E) rank the tokens of expert b, block E advances the
// call number, takes the writable snapshot and zeroes the arrival counts, blocks E + 1 + t quantize token t
// (FP8; none for bf16).
__global__ void k_dispatch_prepare(Call call, const int64_t* topk, int32_t num_tokens, int32_t top_k,
                                   const uint16_t* x, Scratch scratch) {
    const int32_t E = call.num_experts, block = int32_t(blockIdx.x);
    if (block < E) {
        rank_tokens(block, topk, num_tokens, top_k, scratch);
    } else if (block == E) {
        // the whole int64 word (the count is its low half)
        for (int which = threadIdx.x; which < kArrivals; which += blockDim.x)
            reinterpret_cast<int64_t*>(call.call_word)[1 + call.num_ranks + which] = 0;
        advance_call(call);
    } else {
        quantize_token(block - E - 1, x, call.hidden, scratch);
    }
}

// row_warps(call) warps per (token, k), a part of the row each: the token's row (bf16, or its FP8 codes and
// scales) goes into dispatch_data[l][rank][slot] of the expert's owner, its index into dispatch_src.
__device__ __forceinline__ void dispatch_rows(const Call& call, const Region& region, const uint8_t* x,
                                              const int64_t* topk, int32_t num_tokens, int32_t top_k, bool use_fp8,
                                              const Scratch& scratch) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = int64_t(gridDim.x) * kWarps;
    const int32_t R = call.num_ranks, T = call.max_tokens, H = call.hidden, E = call.num_experts;
    const int32_t L = E / R, G = H / kScaleGroup;
    const int64_t row_bytes = 2 * int64_t(H);
    const int32_t parts = row_warps(call);
    for (int64_t item = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); item < int64_t(num_tokens) * top_k * parts;
         item += warps) {
        const int64_t pair = item / parts;
        const int32_t part = int32_t(item % parts);
        const int64_t expert = topk[pair];
        if (expert < 0 || expert >= E) continue;
        const int32_t dest = int32_t(expert / L), local = int32_t(expert % L);
        if (!writable(call, dest)) continue;
        uint8_t* half = half_base(call, region, dest);
        if (half == nullptr) continue;
        const int64_t t = pair / top_k;
        const int32_t rank_in_expert = scratch.slots[pair];
        if (rank_in_expert < 0) continue;  // a repeated entry: sent with its first occurrence
        const int64_t slot = (int64_t(local) * R + call.rank) * T + rank_in_expert;
        uint8_t* row = half + region.dispatch_data + slot * row_bytes;
        if (use_fp8) {
            const RowPart piece = row_part(H, part, parts);
            warp_copy(row + piece.offset, scratch.fp8_rows + t * H + piece.offset, piece.bytes, lane);
            float* scales = reinterpret_cast<float*>(half + region.dispatch_scales) + slot * G;
            if (part == 0)
                for (int32_t g = lane; g < G; g += 32) scales[g] = scratch.fp8_scales[t * G + g];
        } else {
            const RowPart piece = row_part(row_bytes, part, parts);
            warp_copy(row + piece.offset, x + t * row_bytes + piece.offset, piece.bytes, lane);
        }
        if (lane == 0 && part == 0) reinterpret_cast<int32_t*>(half + region.dispatch_src)[slot] = int32_t(t);
    }
    block_fence_system();  // the block's rows are visible system-wide before any signal
}

__global__ void k_dispatch_rows(Call call, Region region, const uint8_t* x, const int64_t* topk, int32_t num_tokens,
                                int32_t top_k, bool use_fp8, Scratch scratch) {
    dispatch_rows(call, region, x, topk, num_tokens, top_k, use_fp8, scratch);
}

// Thread per expert: dispatch_signals[rank][l] of the expert's owner = (tag << 32) | count. `fence_each`:
// every thread fences at system scope first (the split launches' kernel of its own); the fused launches'
// last block had one thread fence at system scope before its threads met (arrived_last).
__device__ __forceinline__ void dispatch_signals(const Call& call, const Region& region, const Scratch& scratch,
                                                 bool fence_each) {
    const int32_t R = call.num_ranks, E = call.num_experts, L = E / R;
    const uint32_t tag = call_tag(*reinterpret_cast<const uint64_t*>(call.call_word));
    if (fence_each) __threadfence_system();
    for (int32_t expert = threadIdx.x; expert < E; expert += blockDim.x) {
        const int32_t dest = expert / L, local = expert % L;
        if (!writable(call, dest)) continue;
        uint8_t* half = half_base(call, region, dest);
        if (half == nullptr) continue;
        auto* signal = reinterpret_cast<uint64_t*>(half + region.dispatch_signals) + int64_t(call.rank) * L + local;
        store_release_sys(signal, make_signal(tag, uint32_t(scratch.send_counts[expert])));
    }
}

__global__ void k_dispatch_signals(Call call, Region region, Scratch scratch) {
    dispatch_signals(call, region, scratch, true);
}

// Fused: the rows, then (the block that arrives last) the signals.
__global__ void k_dispatch_rows_signals(Call call, Region region, const uint8_t* x, const int64_t* topk,
                                        int32_t num_tokens, int32_t top_k, bool use_fp8, Scratch scratch) {
    dispatch_rows(call, region, x, topk, num_tokens, top_k, use_fp8, scratch);
    if (arrived_last(arrivals(call, kArriveDispatchRows), true)) dispatch_signals(call, region, scratch, false);
}

// ---------------------------------------------------------------------------------------------
// Receive side: the per-source wait (shared by dispatch and combine)
// ---------------------------------------------------------------------------------------------

// Block `source` (one warp): wait until `signals[0..L)` all carry the call's tag, each count <= T.
// On a deadline, an abort or a bad count: the source is cleared in active_ranks, flagged in the
// control words, and its counts are 0. `counts` (may be null) receives the accepted counts.
// Launched with one warp per block (blockDim.x == 32).
__device__ void wait_source(const Call& call, const uint64_t* signals, int32_t source, int32_t L, int32_t* counts) {
    const int lane = threadIdx.x & 31;
    // One read of the caller's mask for the whole warp: another call sharing it may clear the source meanwhile
    // (its wait timed out), and lanes that disagreed would leave the warp split at the __syncwarp below.
    __shared__ volatile int32_t source_active;
    __shared__ volatile int32_t source_failed;  // one lane's verdict ends every lane's wait
    if (lane == 0) {
        source_active = is_active(call, source);
        source_failed = 0;
    }
    __syncwarp();
    if (!source_active) {
        if (counts)
            for (int32_t l = lane; l < L; l += 32) counts[l] = 0;
        return;
    }
    const uint32_t tag = call_tag(*reinterpret_cast<const uint64_t*>(call.call_word));
    const uint64_t start = global_timer_ns();
    // Capped at 2^40 us (about 12.7 days), as on the CPU (common.cpp Waiter), so that no valid int64
    // timeout_us overflows the nanosecond budget into a short one.
    const int64_t capped_us = call.timeout_us < (int64_t(1) << 40) ? call.timeout_us : (int64_t(1) << 40);
    const uint64_t budget = call.timeout_us < 0 ? 0 : uint64_t(capped_us) * 1000u;
    const auto* dead = reinterpret_cast<const volatile int32_t*>(call.dead);
    for (int32_t l = lane; l < L && !source_failed; l += 32) {
        for (uint32_t polls = 0;; ++polls) {
            const uint64_t value = load_acquire_sys(signals + l);
            if (signal_tag(value) == tag) {
                const uint32_t count = signal_count(value);
                if (count > uint32_t(call.max_tokens)) source_failed = 1;  // a protocol error: the source failed
                else if (counts) counts[l] = int32_t(count);
                break;
            }
            if (source_failed) break;
            // Every 16 polls (the mapped host words cross the bus): destroy(), the deadline, or the
            // peer watcher's verdict that the source's process ended.
            if ((polls & 15) == 15 && (aborted(call) || (dead != nullptr && dead[source] != 0) ||
                                       (call.timeout_us >= 0 && global_timer_ns() - start > budget))) {
                source_failed = 1;
                break;
            }
            __nanosleep(128);
        }
    }
    __syncwarp();
    if (source_failed) {
        if (counts)
            for (int32_t l = lane; l < L; l += 32) counts[l] = 0;
        if (lane == 0) {
            reinterpret_cast<volatile int32_t*>(call.active)[source] = 0;
            reinterpret_cast<volatile int32_t*>(call.control)[1 + source] = 1;
            __threadfence_system();
        }
    }
}

// Block `source` (one warp): its dispatch signals into recv_counts (wait_source).
__device__ __forceinline__ void dispatch_wait(const Call& call, const Region& region, const Scratch& scratch) {
    const int32_t source = blockIdx.x, L = call.num_experts / call.num_ranks;
    const uint8_t* half = half_base(call, region, call.rank);
    const auto* signals = reinterpret_cast<const uint64_t*>(half + region.dispatch_signals) + int64_t(source) * L;
    wait_source(call, signals, source, L, scratch.recv_counts + int64_t(source) * L);
}

__global__ void k_dispatch_wait(Call call, Region region, Scratch scratch) { dispatch_wait(call, region, scratch); }

// Thread per local expert: begins (sources ascending), layout_range and recv_count.
__device__ __forceinline__ void dispatch_layout(const Call& call, const Scratch& scratch, int64_t* layout_range,
                                                int32_t* recv_count) {
    const int32_t R = call.num_ranks, L = call.num_experts / R;
    for (int32_t l = threadIdx.x; l < L; l += blockDim.x) {
        int64_t begin = 0;
        for (int32_t s = 0; s < R; ++s) {
            const int32_t count = scratch.recv_counts[int64_t(s) * L + l];
            scratch.recv_begins[int64_t(s) * L + l] = int32_t(begin);
            // an inactive (or failed) source has range 0, as on the CPU (dataplane.cpp pack_dispatch)
            layout_range[int64_t(l) * R + s] = is_active(call, s) ? (begin << 32) | int64_t(count) : 0;
            begin += count;
        }
        recv_count[l] = int32_t(begin);
    }
}

__global__ void k_dispatch_layout(Call call, Scratch scratch, int64_t* layout_range, int32_t* recv_count) {
    dispatch_layout(call, scratch, layout_range, recv_count);
}

// Fused: block `source` (one warp) waits for it, then the block that arrives last lays out every source's counts.
__global__ void k_dispatch_wait_layout(Call call, Region region, Scratch scratch, int64_t* layout_range,
                                       int32_t* recv_count) {
    dispatch_wait(call, region, scratch);
    if (arrived_last(arrivals(call, kArriveDispatchWait), false))
        dispatch_layout(call, scratch, layout_range, recv_count);
}

// Blocks (source, l, z): that source's rows of local expert l into recv_x[l][begin..], src_info and
// (FP8) the scales, token axis contiguous [L][G][R*T]; the gridDim.z blocks of one (source, l) take
// every gridDim.z-th group of kWarps row parts (row_warps(call) warps a row). Blocks (R, l, z) zero
// src_info past the count.
__global__ void k_dispatch_unpack(Call call, Region region, bool use_fp8, Scratch scratch, uint8_t* recv_x,
                                  float* recv_scales, int32_t* src_info, const int32_t* recv_count) {
    const int32_t R = call.num_ranks, T = call.max_tokens, H = call.hidden, L = call.num_experts / R;
    const int32_t G = H / kScaleGroup;
    const int32_t source = blockIdx.x, local = blockIdx.y;
    const int64_t rows = int64_t(R) * T;
    if (source == R) {
        for (int64_t i = recv_count[local] + int64_t(blockIdx.z) * blockDim.x + threadIdx.x; i < rows;
             i += int64_t(gridDim.z) * blockDim.x)
            src_info[local * rows + i] = 0;
        return;
    }
    const int32_t count = scratch.recv_counts[int64_t(source) * L + local];
    if (count == 0) return;
    const int64_t begin = scratch.recv_begins[int64_t(source) * L + local];
    const uint8_t* half = half_base(call, region, call.rank);
    const int64_t row_bytes = 2 * int64_t(H), out_bytes = use_fp8 ? H : row_bytes;
    const int lane = threadIdx.x & 31;
    const int32_t parts = row_warps(call);
    for (int64_t item = int64_t(blockIdx.z) * kWarps + (threadIdx.x >> 5); item < int64_t(count) * parts;
         item += int64_t(gridDim.z) * kWarps) {
        const int64_t i = item / parts;
        const int32_t part = int32_t(item % parts);
        const int64_t slot = (int64_t(local) * R + source) * T + i;
        const int64_t row = begin + i;
        const RowPart piece = row_part(out_bytes, part, parts);
        warp_copy(recv_x + (local * rows + row) * out_bytes + piece.offset,
                  half + region.dispatch_data + slot * row_bytes + piece.offset, piece.bytes, lane);
        if (part != 0) continue;
        if (use_fp8) {
            const float* scales = reinterpret_cast<const float*>(half + region.dispatch_scales) + slot * G;
            for (int32_t g = lane; g < G; g += 32) recv_scales[(int64_t(local) * G + g) * rows + row] = scales[g];
        }
        if (lane == 0) src_info[local * rows + row] = reinterpret_cast<const int32_t*>(half + region.dispatch_src)[slot];
    }
}

// ---------------------------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------------------------

// The combine's own snapshot of writable peers (a peer may have died since the dispatch).
__global__ void k_snapshot_writable(Call call) { snapshot_writable(call); }

// Blocks (source, l, z): rows x[l][begin + i] go to combine_data[rank*L + l][src_info[l][begin + i]] of
// the token owner `source`, every gridDim.z-th group of kWarps row parts per block (row_warps(call) warps a
// row). Counts and token indices are bounds-checked (a bad one is skipped).
__device__ __forceinline__ void combine_rows(const Call& call, const Region& region, const uint8_t* x,
                                             const int32_t* src_info, const int64_t* layout_range) {
    const int32_t R = call.num_ranks, T = call.max_tokens, H = call.hidden, L = call.num_experts / R;
    const int32_t source = blockIdx.x, local = blockIdx.y;
    if (writable(call, source)) {
        uint8_t* half = half_base(call, region, source);
        const int64_t range = layout_range[int64_t(local) * R + source];
        const int64_t begin = range >> 32, count = range & 0xffffffff;
        const int64_t rows = int64_t(R) * T, row_bytes = 2 * int64_t(H);
        if (half != nullptr && count <= T && begin >= 0 && begin + count <= rows) {
            const int lane = threadIdx.x & 31;
            const int32_t parts = row_warps(call);
            for (int64_t item = int64_t(blockIdx.z) * kWarps + (threadIdx.x >> 5); item < count * parts;
                 item += int64_t(gridDim.z) * kWarps) {
                const int64_t i = item / parts;
                const int32_t t = src_info[local * rows + begin + i];
                if (t < 0 || t >= T) continue;
                const int64_t expert = int64_t(call.rank) * L + local;
                const RowPart piece = row_part(row_bytes, int32_t(item % parts), parts);
                warp_copy(half + region.combine_data + (expert * T + t) * row_bytes + piece.offset,
                          x + (local * rows + begin + i) * row_bytes + piece.offset, piece.bytes, lane);
            }
        }
    }
    block_fence_system();  // the block's rows are visible system-wide before any signal
}

__global__ void k_combine_rows(Call call, Region region, const uint8_t* x, const int32_t* src_info,
                               const int64_t* layout_range) {
    combine_rows(call, region, x, src_info, layout_range);
}

// Thread per (token owner, l): combine_signals[rank*L + l] of the owner = (tag << 32) | count. `fence_each`:
// as dispatch_signals'.
__device__ __forceinline__ void combine_signals(const Call& call, const Region& region, const int64_t* layout_range,
                                                bool fence_each) {
    const int32_t R = call.num_ranks, L = call.num_experts / R;
    const uint32_t tag = call_tag(*reinterpret_cast<const uint64_t*>(call.call_word));
    if (fence_each) __threadfence_system();
    for (int32_t index = threadIdx.x; index < R * L; index += blockDim.x) {
        const int32_t source = index / L, local = index % L;
        if (!writable(call, source)) continue;
        uint8_t* half = half_base(call, region, source);
        if (half == nullptr) continue;
        const uint32_t count = uint32_t(layout_range[int64_t(local) * R + source] & 0xffffffff);
        auto* signal = reinterpret_cast<uint64_t*>(half + region.combine_signals) + int64_t(call.rank) * L + local;
        store_release_sys(signal, make_signal(tag, count));
    }
}

__global__ void k_combine_signals(Call call, Region region, const int64_t* layout_range) {
    combine_signals(call, region, layout_range, true);
}

// Fused: the rows, then (the block that arrives last) the signals.
__global__ void k_combine_rows_signals(Call call, Region region, const uint8_t* x, const int32_t* src_info,
                                       const int64_t* layout_range) {
    combine_rows(call, region, x, src_info, layout_range);
    if (arrived_last(arrivals(call, kArriveCombineRows), true)) combine_signals(call, region, layout_range, false);
}

__global__ void k_combine_wait(Call call, Region region) {
    const int32_t owner = blockIdx.x, L = call.num_experts / call.num_ranks;
    const uint8_t* half = half_base(call, region, call.rank);
    const auto* signals = reinterpret_cast<const uint64_t*>(half + region.combine_signals) + int64_t(owner) * L;
    wait_source(call, signals, owner, L, nullptr);
}

// Up to two bf16 bias tensors `[num_tokens, hidden]` (rows `stride` bytes apart; null = absent) that the
// combine's sums start from: channel c < hidden of token t adds bias0[t][c] and then bias1[t][c], each
// with weight 1.0, before the rows (as if they were the first two rows of the top-k), exactly as the CPU
// transports' reduction (csrc/dataplane/rows.h RowBias, biased_sum_row); channels past `hidden` sum the
// rows alone. Read where they are: no bias row is ever copied.
struct Bias {
    const uint8_t* bias0;
    const uint8_t* bias1;
    int64_t stride;
    int64_t hidden;
};

// Channel c of token t's sum after its bias rows: 0.0f + 1.0f * bias0 + 1.0f * bias1, each a separate
// multiply and add (the CPU's operations, so a bias of -0.0 gives +0.0 there too).
__device__ __forceinline__ float bias_start(const Bias& bias, int64_t t, int64_t c) {
    float acc = 0.0f;
    if (c >= bias.hidden) return acc;
    const uint8_t* const parts[2] = {bias.bias0, bias.bias1};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const uint8_t* rows = parts[i];
        if (rows == nullptr) continue;
        const uint16_t value = reinterpret_cast<const uint16_t*>(rows + t * bias.stride)[c];
        acc = __fadd_rn(acc, __fmul_rn(1.0f, bf16_to_float(value)));
    }
    return acc;
}

// Rows of a token whose loads k_combine_reduce issues before it sums any of them.
constexpr int kRowsInFlight = 4;

// Channel pair (lo, hi) of a bf16 word += w * row, a separate multiply and add each (never fused).
__device__ __forceinline__ void add_pair(float& lo, float& hi, float w, uint32_t pair) {
    lo = __fadd_rn(lo, __fmul_rn(w, bf16_to_float(uint16_t(pair & 0xffffu))));
    hi = __fadd_rn(hi, __fmul_rn(w, bf16_to_float(uint16_t(pair >> 16))));
}

__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
    return uint32_t(float_to_bf16(lo)) | (uint32_t(float_to_bf16(hi)) << 16);
}

// Block t: out[t] = bf16(bias0[t] + bias1[t] + sum over k in order of w[t,k] * float(combine_data[e_k][t])),
// in float32 with a separate multiply and add (never fused), skipping -1 and inactive owners. Where the
// rows and `out` are 16-byte aligned (hidden is a multiple of 128: every row is when its region is), a
// thread sums 8 channels with one 16-byte load per row, the loads of kRowsInFlight rows issued before
// their sums; else 2 channels with 4-byte loads (stored as one 4-byte word, or as two bf16 where `out` is 2
// bytes off a 4-byte boundary). Each channel is the same float32 operations in the same
// order either way (its bias, then the rows in top-k order): the same bits. Dynamic shared memory: K
// expert ids (int64) then K weights (float).
__global__ void k_combine_reduce(Call call, Region region, const int64_t* topk, const float* weights, int32_t top_k,
                                 uint16_t* out, Bias bias) {
    int64_t* shared = dynamic_shared<int64_t>();
    int64_t* experts = shared;
    float* w = reinterpret_cast<float*>(shared + top_k);
    const int32_t R = call.num_ranks, T = call.max_tokens, H = call.hidden, E = call.num_experts, L = E / R;
    const int64_t t = blockIdx.x;
    for (int32_t k = threadIdx.x; k < top_k; k += blockDim.x) {
        int64_t expert = topk[t * top_k + k];
        if (expert < 0 || expert >= E || !is_active(call, int32_t(expert / L))) expert = -1;
        experts[k] = expert;
        w[k] = weights[t * top_k + k];
    }
    __syncthreads();
    const uint8_t* half = half_base(call, region, call.rank);
    const uint8_t* rows = half + region.combine_data;
    if (H % 8 == 0 && ((reinterpret_cast<uintptr_t>(rows) | reinterpret_cast<uintptr_t>(out)) & 15u) == 0) {
        const auto* data = reinterpret_cast<const int4*>(rows);
        const int64_t groups = H / 8;  // 16-byte groups of 8 channels a row
        for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
            float acc[8];
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[c] = bias_start(bias, t, 8 * g + c);
            for (int32_t k0 = 0; k0 < top_k; k0 += kRowsInFlight) {
                int4 got[kRowsInFlight];
#pragma unroll
                for (int i = 0; i < kRowsInFlight; ++i) {  // the loads first: the rows are read together
                    const int64_t expert = k0 + i < top_k ? experts[k0 + i] : -1;
                    got[i] = expert >= 0 ? data[(expert * T + t) * groups + g] : int4{0, 0, 0, 0};
                }
#pragma unroll
                for (int i = 0; i < kRowsInFlight; ++i) {  // then the sums, in top-k order
                    if (k0 + i >= top_k || experts[k0 + i] < 0) continue;
                    const float weight = w[k0 + i];
                    add_pair(acc[0], acc[1], weight, uint32_t(got[i].x));
                    add_pair(acc[2], acc[3], weight, uint32_t(got[i].y));
                    add_pair(acc[4], acc[5], weight, uint32_t(got[i].z));
                    add_pair(acc[6], acc[7], weight, uint32_t(got[i].w));
                }
            }
            reinterpret_cast<int4*>(out)[t * groups + g] =
                int4{int(bf16_pair(acc[0], acc[1])), int(bf16_pair(acc[2], acc[3])), int(bf16_pair(acc[4], acc[5])),
                     int(bf16_pair(acc[6], acc[7]))};
        }
        return;
    }
    const auto* data = reinterpret_cast<const uint32_t*>(rows);
    const int64_t words_per_row = H / 2;
    const bool out_pairs = (reinterpret_cast<uintptr_t>(out) & 3u) == 0;
    for (int64_t j = threadIdx.x; j < words_per_row; j += blockDim.x) {
        float lo = bias_start(bias, t, 2 * j), hi = bias_start(bias, t, 2 * j + 1);
        for (int32_t k = 0; k < top_k; ++k) {
            const int64_t expert = experts[k];
            if (expert < 0) continue;
            add_pair(lo, hi, w[k], data[(expert * T + t) * words_per_row + j]);
        }
        const int64_t at = t * words_per_row + j;
        if (out_pairs) {
            reinterpret_cast<uint32_t*>(out)[at] = bf16_pair(lo, hi);
        } else {  // `out` 2 bytes off a 4-byte boundary: a 4-byte store there faults on the GPU
            out[2 * at] = float_to_bf16(lo);
            out[2 * at + 1] = float_to_bf16(hi);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Value checks (eager calls)
// ---------------------------------------------------------------------------------------------

__device__ void report(int32_t* problem, int32_t code, int64_t row, int64_t column, int64_t value) {
    if (atomicCAS(problem, 0, code) == 0) {
        problem[1] = int32_t(row);
        problem[2] = int32_t(column);
        problem[3] = int32_t(value < -2147483647LL ? -2147483647LL : (value > 2147483647LL ? 2147483647LL : value));
    }
}

__global__ void k_check_values(const int64_t* topk, int32_t num_tokens, int32_t top_k, int32_t num_experts,
                               const int32_t* active, int32_t num_ranks, int32_t* problem) {
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int64_t t = first; t < num_tokens; t += stride)
        for (int32_t k = 0; k < top_k; ++k) {
            const int64_t v = topk[t * top_k + k];
            if (v < -1 || v >= num_experts) {
                report(problem, 1, t, k, v);
                continue;
            }
            for (int32_t j = 0; j < k && v >= 0; ++j)
                if (topk[t * top_k + j] == v) report(problem, 2, t, k, v);
        }
    for (int64_t r = first; r < num_ranks; r += stride)
        if (active[r] != 0 && active[r] != 1) report(problem, 3, r, 0, active[r]);
}

Stream as_stream(uintptr_t stream) { return reinterpret_cast<Stream>(stream); }

// Blocks along z for kernels with a block per (peer, local expert): about call.grid_blocks blocks in all
// (default 264: two per multiprocessor of an H100's 132; an R=2 E=32 call has only 32 such pairs), never
// more than one block per kWarps row parts of one pair, nor past the grid's 65535 in z.
unsigned split_blocks(const Call& call, int32_t pairs) {
    const int64_t target = call.grid_blocks > 0 ? call.grid_blocks : 264;
    int64_t z = (target + pairs - 1) / pairs;
    const int64_t most = (int64_t(call.max_tokens) * row_warps(call) + kWarps - 1) / kWarps;
    if (z > most) z = most;
    if (z > 65535) z = 65535;
    return unsigned(z < 1 ? 1 : z);
}

int copy_blocks(int64_t warps_needed) {
    const int64_t blocks = (warps_needed + kWarps - 1) / kWarps;
    return int(blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

int64_t dispatch_scratch_bytes(int32_t num_ranks, int32_t max_tokens, int32_t hidden, int32_t num_experts,
                               int32_t top_k) {
    return 2 * scratch_sizes(num_ranks, max_tokens, hidden, num_experts, top_k).half;
}

int64_t call_word_size(int32_t num_ranks) {
    if (num_ranks < 1) throw std::invalid_argument("num_ranks: expected >= 1, got " + std::to_string(num_ranks));
    return 1 + int64_t(num_ranks) + kArrivals;
}

// Shape limits of the launches (the Python layer checks the call first; these keep a direct
// caller from launching out of bounds).
void check_call(const Call& call) {
    if (call.num_ranks < 1 || call.rank < 0 || call.rank >= call.num_ranks)
        throw std::invalid_argument("call: rank " + std::to_string(call.rank) + " outside [0, " +
                                    std::to_string(call.num_ranks) + ")");
    if (call.hidden <= 0 || call.hidden % kScaleGroup != 0)
        throw std::invalid_argument("hidden: expected a positive multiple of 128, got " + std::to_string(call.hidden));
    if (call.num_experts < call.num_ranks || call.num_experts % call.num_ranks != 0 ||
        call.num_experts / call.num_ranks > 65535)
        throw std::invalid_argument("num_experts: expected a multiple of num_ranks with at most 65535 local experts, got " +
                                    std::to_string(call.num_experts));
    if (call.max_tokens < 1) throw std::invalid_argument("max_tokens: expected >= 1");
    if (call.half_index != 0 && call.half_index != 1) throw std::invalid_argument("half_index: expected 0 or 1");
    if (call.fused != 0 && call.fused != 1) throw std::invalid_argument("fused: expected 0 or 1");
    if (call.row_warps < 0 || call.row_warps > 32)
        throw std::invalid_argument("row_warps: expected [0, 32] (0 = 1), got " + std::to_string(call.row_warps));
    if (call.grid_blocks < 0 || call.grid_blocks > (1 << 20))
        throw std::invalid_argument("grid_blocks: expected [0, 2^20] (0 = 264), got " +
                                    std::to_string(call.grid_blocks));
    if (!call.peer_bases || !call.active || !call.counter || !call.call_word || !call.control)
        throw std::invalid_argument("call: a null device address");
}

void dispatch_send(const Call& call, const Region& region, uintptr_t x, int32_t num_tokens, uintptr_t topk_idx,
                   int32_t top_k, bool use_fp8, uintptr_t scratch_base, uintptr_t stream) {
    check_call(call);
    if (num_tokens < 0 || num_tokens > call.max_tokens)
        throw std::invalid_argument("num_tokens: expected [0, " + std::to_string(call.max_tokens) + "], got " +
                                    std::to_string(num_tokens));
    if (top_k < 1 || top_k > call.num_experts) throw std::invalid_argument("top_k: expected [1, num_experts]");
    const Scratch scratch = carve(scratch_base, call.half_index, call.num_ranks, call.max_tokens, call.hidden,
                                  call.num_experts, top_k);
    const auto* topk = reinterpret_cast<const int64_t*>(topk_idx);
    const Stream s = as_stream(stream);
    if (call.fused) {  // two launches: ranking, call word and quantization; then rows and signals
        const int64_t blocks = int64_t(call.num_experts) + 1 + (use_fp8 ? num_tokens : 0);
        MEP_LAUNCH(k_dispatch_prepare, unsigned(blocks), kThreads, 0, s, call, topk, num_tokens, top_k,
                   reinterpret_cast<const uint16_t*>(x), scratch);
        MEP_LAUNCH(k_dispatch_rows_signals, copy_blocks(int64_t(num_tokens) * top_k * row_warps(call)), kThreads, 0, s,
                   call, region, reinterpret_cast<const uint8_t*>(x), topk, num_tokens, top_k, use_fp8, scratch);
        return;
    }
    MEP_LAUNCH(k_advance_call, 1, kThreads, 0, s, call);
    MEP_LAUNCH(k_rank_tokens, call.num_experts, kThreads, 0, s, topk, num_tokens, top_k, scratch);
    if (use_fp8 && num_tokens > 0) {
        MEP_LAUNCH(k_quantize, num_tokens, kThreads, 0, s, reinterpret_cast<const uint16_t*>(x), call.hidden, scratch);
    }
    if (num_tokens > 0) {
        MEP_LAUNCH(k_dispatch_rows, copy_blocks(int64_t(num_tokens) * top_k * row_warps(call)), kThreads, 0, s, call, region, reinterpret_cast<const uint8_t*>(x), topk, num_tokens, top_k, use_fp8, scratch);
    }
    MEP_LAUNCH(k_dispatch_signals, 1, kThreads, 0, s, call, region, scratch);
}

void dispatch_recv(const Call& call, const Region& region, bool use_fp8, int32_t top_k, uintptr_t scratch_base,
                   uintptr_t recv_x, uintptr_t recv_scales, uintptr_t src_info, uintptr_t layout_range,
                   uintptr_t recv_count, uintptr_t stream) {
    check_call(call);
    const Scratch scratch = carve(scratch_base, call.half_index, call.num_ranks, call.max_tokens, call.hidden,
                                  call.num_experts, top_k);
    const Stream s = as_stream(stream);
    const int32_t L = call.num_experts / call.num_ranks;
    if (call.fused) {
        MEP_LAUNCH(k_dispatch_wait_layout, call.num_ranks, 32, 0, s, call, region, scratch,
                   reinterpret_cast<int64_t*>(layout_range), reinterpret_cast<int32_t*>(recv_count));
    } else {
        MEP_LAUNCH(k_dispatch_wait, call.num_ranks, 32, 0, s, call, region, scratch);
        MEP_LAUNCH(k_dispatch_layout, 1, kThreads, 0, s, call, scratch, reinterpret_cast<int64_t*>(layout_range),
                   reinterpret_cast<int32_t*>(recv_count));
    }
    MEP_LAUNCH(k_dispatch_unpack, dim3(call.num_ranks + 1, L, split_blocks(call, (call.num_ranks + 1) * L)), kThreads, 0, s, call, region, use_fp8, scratch, reinterpret_cast<uint8_t*>(recv_x), reinterpret_cast<float*>(recv_scales), reinterpret_cast<int32_t*>(src_info), reinterpret_cast<const int32_t*>(recv_count));
}

void combine_send(const Call& call, const Region& region, uintptr_t x, uintptr_t src_info, uintptr_t layout_range,
                  uintptr_t stream) {
    check_call(call);
    const Stream s = as_stream(stream);
    const int32_t L = call.num_experts / call.num_ranks;
    MEP_LAUNCH(k_snapshot_writable, 1, kThreads, 0, s, call);
    if (call.fused) {
        MEP_LAUNCH(k_combine_rows_signals, dim3(call.num_ranks, L, split_blocks(call, call.num_ranks * L)),
                   kThreads, 0, s, call, region, reinterpret_cast<const uint8_t*>(x),
                   reinterpret_cast<const int32_t*>(src_info), reinterpret_cast<const int64_t*>(layout_range));
        return;
    }
    MEP_LAUNCH(k_combine_rows, dim3(call.num_ranks, L, split_blocks(call, call.num_ranks * L)), kThreads, 0, s, call, region, reinterpret_cast<const uint8_t*>(x), reinterpret_cast<const int32_t*>(src_info), reinterpret_cast<const int64_t*>(layout_range));
    MEP_LAUNCH(k_combine_signals, 1, kThreads, 0, s, call, region, reinterpret_cast<const int64_t*>(layout_range));
}

void combine_recv(const Call& call, const Region& region, uintptr_t topk_idx, uintptr_t topk_weights,
                  int32_t num_tokens, int32_t top_k, uintptr_t out, uintptr_t stream, uintptr_t bias0_ptr,
                  uintptr_t bias1_ptr, int64_t bias_stride, int64_t bias_hidden) {
    check_call(call);
    if (num_tokens < 0 || num_tokens > call.max_tokens)
        throw std::invalid_argument("num_tokens: expected [0, " + std::to_string(call.max_tokens) + "], got " +
                                    std::to_string(num_tokens));
    if (top_k < 1 || top_k > 4096) throw std::invalid_argument("top_k: expected [1, 4096] (shared memory per token)");
    Bias bias{nullptr, nullptr, 0, 0};
    if (bias0_ptr != 0 || bias1_ptr != 0) {  // the CPU reduction's checks (make_row_bias), and bf16 alignment
        if (bias_hidden <= 0 || bias_hidden > call.hidden)
            throw std::invalid_argument("bias_hidden: expected [1, " + std::to_string(call.hidden) +
                                        "] (the combine's hidden), got " + std::to_string(bias_hidden));
        if (bias_stride < 2 * bias_hidden || bias_stride % 2 != 0)
            throw std::invalid_argument("bias_stride: expected an even number of bytes >= " +
                                        std::to_string(2 * bias_hidden) + " (2 * bias_hidden), got " +
                                        std::to_string(bias_stride));
        if ((bias0_ptr | bias1_ptr) % 2 != 0)
            throw std::invalid_argument("bias0_ptr, bias1_ptr: expected 2-byte aligned bf16 rows, got an odd address");
        bias = Bias{reinterpret_cast<const uint8_t*>(bias0_ptr), reinterpret_cast<const uint8_t*>(bias1_ptr),
                    bias_stride, bias_hidden};
    }
    const Stream s = as_stream(stream);
    MEP_LAUNCH(k_combine_wait, call.num_ranks, 32, 0, s, call, region);
    if (num_tokens > 0) {
        const size_t shared = size_t(top_k) * (sizeof(int64_t) + sizeof(float));
        MEP_LAUNCH(k_combine_reduce, num_tokens, kThreads, shared, s, call, region, reinterpret_cast<const int64_t*>(topk_idx), reinterpret_cast<const float*>(topk_weights), top_k, reinterpret_cast<uint16_t*>(out), bias);
    }
}

void check_values(uintptr_t topk_idx, int32_t num_tokens, int32_t top_k, int32_t num_experts, uintptr_t active,
                  int32_t num_ranks, uintptr_t problem, uintptr_t stream) {
    const int64_t work = num_tokens > num_ranks ? num_tokens : num_ranks;
    const int blocks = int((work + kThreads - 1) / kThreads);
    MEP_LAUNCH(k_check_values, blocks < 1 ? 1 : blocks, kThreads, 0, as_stream(stream), reinterpret_cast<const int64_t*>(topk_idx), num_tokens, top_k, num_experts, reinterpret_cast<const int32_t*>(active), num_ranks, reinterpret_cast<int32_t*>(problem));
}

}  // namespace mep_cuda
