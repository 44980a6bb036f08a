// The CUDA data plane that module.cpp exposes as mooncake_ep_switch._cuda: device regions shared
// between processes through CUDA IPC handles (the NVLink path), and the dispatch/combine kernels
// of docs/protocol.md on raw device pointers. No torch linkage: pointers and streams arrive as
// integers, so the module works under any torch build. Every launch is asynchronous on the given
// stream and never synchronizes the host, so a dispatch/combine pair can be captured in a CUDA graph.
#pragma once

#include <cstdint>
#include <string>

namespace mep_cuda {

// ---- runtime (runtime.cu) ----
// Devices the CUDA runtime sees; 0 (never an exception) with no driver or no device.
int device_count();
// Why device_count() is 0: the runtime's error string, or "" when devices exist.
std::string device_status();
// The calling thread's current device.
int current_device();
// cudaMalloc `nbytes` on `device` and zero it (synchronously); returns the device address.
uintptr_t device_alloc(int64_t nbytes, int device);
void device_free(uintptr_t ptr);
// Pinned host memory mapped into the device's address space (zeroed); the same address is valid
// on the host and the device (unified addressing).
uintptr_t mapped_host_alloc(int64_t nbytes);
void mapped_host_free(uintptr_t ptr);
// The 64-byte IPC handle of a cudaMalloc'd allocation, and opening a peer's (another process's).
std::string ipc_handle(uintptr_t ptr);
uintptr_t ipc_open(const std::string& handle, int device);
void ipc_close(uintptr_t ptr);
// Bytes from `ptr` to the end of the device allocation holding it (cuMemGetAddressRange): an opened peer
// handle is checked against the size its owner claimed.
int64_t allocation_bytes(uintptr_t ptr);
// Synchronous copies (membership changes only: never on the dispatch/combine path).
void copy_to_device(uintptr_t dst, uintptr_t src, int64_t nbytes);
void copy_to_host(uintptr_t dst, uintptr_t src, int64_t nbytes);
void stream_synchronize(uintptr_t stream);
// Queue the strided copies `desc` [n][6] int64 rows (dst, src, rows, row_bytes, dst_stride, src_stride) on
// `stream` (cudaMemcpy2DAsync / cudaMemcpyAsync, device or IPC-mapped peer addresses), after checking every
// block lies inside [dst_lo, dst_hi) and [src_lo, src_hi) (std::invalid_argument, nothing queued). A runtime
// failure while queuing (a broken device) raises std::runtime_error and may leave earlier blocks queued.
// With `device_desc` (device memory for n * 6 int64, 0 = none: the caller decides, DeviceMoves from 8 blocks on),
// the table is copied there on `stream` and one kernel copies every block (copy_kernels.cuh; KV moves: many small
// blocks). Returns the bytes queued;
// the caller orders what follows (an event on `stream`).
int64_t copy_blocks_async(uintptr_t desc_ptr, int64_t n, uintptr_t dst_lo, uintptr_t dst_hi, uintptr_t src_lo,
                          uintptr_t src_hi, uintptr_t stream, uintptr_t device_desc);

// ---- kernels (ep_kernels.cu) ----
// Offsets of docs/protocol.md's region, from the CPU layout (region_layout): bytes inside a half,
// the half of a call at control_bytes + half_index * half_bytes.
struct Region {
    int64_t control_bytes, half_bytes, dispatch_data, dispatch_scales, dispatch_src, combine_data,
        dispatch_signals, combine_signals;
};

// One call of one rank.
struct Call {
    int32_t num_ranks;     // R
    int32_t rank;
    int32_t max_tokens;    // T
    int32_t hidden;        // H
    int32_t num_experts;   // E
    int32_t half_index;    // 0 or 1: the region half (chosen by the host's call number)
    int64_t host_call;     // the host's call number (see advance)
    uintptr_t peer_bases;  // device array [R] of uint64 region bases as mapped here (0 = unreachable)
    uintptr_t active;      // device int32 [R], the caller's active_ranks
    uintptr_t counter;     // device uint64: the last call number this rank's dispatches used
    uintptr_t call_word;   // device int64 [call_word_size(R)]: [0] the call number of this dispatch (its handle's
                           // word), [1 + r] scratch of the send kernels (whether peer r is writable this phase),
                           // then the fused kernels' arrival counts (zeroed by the dispatch's first kernel)
    uintptr_t control;     // mapped host int32 [1 + R]: [0] abort (destroy), [1 + s] set when s failed
    uintptr_t dead;        // mapped host int32 [R]: set by the peer watcher when s's process ended (0 = none)
    int64_t timeout_us;    // per source, -1 = none
    int32_t advance;       // 0: the call number is host_call; 1: max(counter + 1, host_call) (graphs)
    int32_t fused;         // 1: the fused launches (8 a round trip instead of 12-13), same outputs bit for bit;
                           // they write the arrival counts: call_word must hold call_word_size(R) words
    int32_t row_warps;     // warps that copy one row between them, a part each (0 = 1): launch tuning
    int32_t grid_blocks;   // blocks the per-(peer, local expert) kernels aim for in all (0 = 264): launch tuning
};

// int64 words of a call word (see Call::call_word) for `num_ranks` ranks.
int64_t call_word_size(int32_t num_ranks);

// Scratch of one dispatch shape (device memory the caller owns, sized by dispatch_scratch_bytes).
int64_t dispatch_scratch_bytes(int32_t num_ranks, int32_t max_tokens, int32_t hidden, int32_t num_experts,
                               int32_t top_k);

// Send phase: advance the call number, rank tokens per expert, quantize (FP8), write rows into
// every active peer's region, then its signals (release, system scope).
void dispatch_send(const Call& call, const Region& region, uintptr_t x, int32_t num_tokens, uintptr_t topk_idx,
                   int32_t top_k, bool use_fp8, uintptr_t scratch, uintptr_t stream);
// Receive phase: wait per active source (timeout into active_ranks), then pack recv_x, scales,
// src_info, layout_range and recv_count.
void dispatch_recv(const Call& call, const Region& region, bool use_fp8, int32_t top_k, uintptr_t scratch,
                   uintptr_t recv_x, uintptr_t recv_scales, uintptr_t src_info, uintptr_t layout_range,
                   uintptr_t recv_count, uintptr_t stream);
// Combine send phase: expert output rows to their token owners, then the signals.
void combine_send(const Call& call, const Region& region, uintptr_t x, uintptr_t src_info, uintptr_t layout_range,
                  uintptr_t stream);
// Combine receive phase: wait per active owner, then the fp32 weighted sum in top-k order -> bf16.
// bias0_ptr / bias1_ptr (0 = none): bf16 `[num_tokens, bias_hidden]` rows `bias_stride` bytes apart
// (device memory) that each token's sum starts from on its first bias_hidden channels, bias 0 then
// bias 1 with weight 1, read in place: the CPU transports' combine_recv bias, bit for bit.
void combine_recv(const Call& call, const Region& region, uintptr_t topk_idx, uintptr_t topk_weights,
                  int32_t num_tokens, int32_t top_k, uintptr_t out, uintptr_t stream, uintptr_t bias0_ptr = 0,
                  uintptr_t bias1_ptr = 0, int64_t bias_stride = 0, int64_t bias_hidden = 0);
// One value pass over the call's routing and mask (eager calls only; the host reads the code):
// writes into `problem` (device int32 [4]) {code, row, column, value}; code 0 = fine, 1 = an id
// outside [-1, E), 2 = an expert twice in a row, 3 = a mask value other than 0 and 1.
void check_values(uintptr_t topk_idx, int32_t num_tokens, int32_t top_k, int32_t num_experts, uintptr_t active,
                  int32_t num_ranks, uintptr_t problem, uintptr_t stream);

}  // namespace mep_cuda
