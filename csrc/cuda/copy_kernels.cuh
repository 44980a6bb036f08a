// The block-copy kernel of device moves (switches, KV moves, rebalances: copy_blocks_async in runtime.cu),
// written once for two builds as ep_kernels.cuh is: nvcc (runtime.cu, module `_cuda`) and the host
// compiler on the block/warp emulator of cuda/sim_device.h (sim.cpp, module `_cuda_sim`, which CI runs
// against the host's copy_blocks).
//
// A table `desc` [n][6] int64 of blocks (dst, src, rows, row_bytes, dst_stride, src_stride), every block
// already checked against its regions by the caller. Each block is cut into pieces: a 16-byte chunk of a row
// where every address, width and stride of the block is a multiple of 16 ("wide"), else a byte. The CTAs
// x = i (mod gridDim.x) take block i, and its pieces are spread over the gridDim.y CTAs of that column and
// their threads, each thread issuing the loads of kCopyInFlight pieces before their stores (a loop of one
// load and one store has one access in flight per thread: a latency-bound copy).
#pragma once

#include <cstdint>

#include "cuda/device.h"

namespace mep_cuda {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyInFlight = 4;
constexpr int64_t kCopyMaxCtas = 8192;  // CTAs of one launch at most (grid-stride beyond)

// piece = row * per_row + column, in 32-bit arithmetic where it fits (a 64-bit division is a long software
// sequence on a GPU, and a block's pieces rarely need it).
__device__ __forceinline__ void split_piece(int64_t piece, int64_t per_row, int64_t& row, int64_t& column) {
    if (((piece | per_row) >> 32) == 0) {
        const uint32_t r = uint32_t(piece) / uint32_t(per_row);
        row = r;
        column = int64_t(uint32_t(piece) - r * uint32_t(per_row));
    } else {
        row = piece / per_row;
        column = piece - row * per_row;
    }
}

__global__ void k_copy_blocks(const int64_t* desc, int64_t n) {
    const int64_t step = int64_t(gridDim.y) * blockDim.x;
    const int64_t first = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
    for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
        const int64_t* d = desc + 6 * i;
        char* dst = reinterpret_cast<char*>(uintptr_t(d[0]));
        const char* src = reinterpret_cast<const char*>(uintptr_t(d[1]));
        const int64_t rows = d[2], width = d[3], dst_stride = d[4], src_stride = d[5];
        if (rows <= 0 || width <= 0) continue;
        if (((d[0] | d[1] | width | dst_stride | src_stride) & 15) == 0) {
            const int64_t chunks = width / 16, pieces = rows * chunks;
            for (int64_t base = first; base < pieces; base += step * kCopyInFlight) {
                int4 got[kCopyInFlight];
                int64_t row[kCopyInFlight], column[kCopyInFlight];
#pragma unroll
                for (int k = 0; k < kCopyInFlight; ++k) {  // the loads first: kCopyInFlight in flight
                    const int64_t piece = base + k * step;
                    if (piece >= pieces) continue;
                    split_piece(piece, chunks, row[k], column[k]);
                    got[k] = *reinterpret_cast<const int4*>(src + row[k] * src_stride + column[k] * 16);
                }
#pragma unroll
                for (int k = 0; k < kCopyInFlight; ++k)
                    if (base + k * step < pieces)
                        *reinterpret_cast<int4*>(dst + row[k] * dst_stride + column[k] * 16) = got[k];
            }
        } else {
            const int64_t pieces = rows * width;
            for (int64_t piece = first; piece < pieces; piece += step) {
                int64_t row, column;
                split_piece(piece, width, row, column);
                dst[row * dst_stride + column] = src[row * src_stride + column];
            }
        }
    }
}

// Bytes of a (host) table's blocks, and the most pieces one of them holds (what launch_copy_blocks sizes by).
struct CopyTotals {
    int64_t bytes, max_pieces;
};

inline CopyTotals copy_totals(const int64_t* desc, int64_t n) {
    CopyTotals totals{0, 0};
    for (int64_t i = 0; i < n; ++i) {
        const int64_t* d = desc + 6 * i;
        totals.bytes += d[2] * d[3];
        const int64_t pieces = d[2] * ((((d[0] | d[1] | d[3] | d[4] | d[5]) & 15) == 0) ? d[3] / 16 : d[3]);
        if (pieces > totals.max_pieces) totals.max_pieces = pieces;
    }
    return totals;
}

// The launch of k_copy_blocks for a table of `n` blocks whose largest holds `max_pieces` pieces: a column of
// CTAs per block (up to 65535), enough CTAs down each column for kCopyInFlight pieces a thread, no more than
// kCopyMaxCtas in all.
void launch_copy_blocks(const int64_t* device_desc, int64_t n, int64_t max_pieces, Stream stream) {
    const int64_t columns = n < 65535 ? n : 65535;
    int64_t down = (max_pieces + int64_t(kCopyThreads) * kCopyInFlight - 1) / (int64_t(kCopyThreads) * kCopyInFlight);
    const int64_t room = kCopyMaxCtas / columns;
    if (down > room) down = room;
    if (down > 65535) down = 65535;
    if (down < 1) down = 1;
    MEP_LAUNCH(k_copy_blocks, dim3(unsigned(columns), unsigned(down)), kCopyThreads, 0, stream, device_desc, n);
}

}  // namespace
}  // namespace mep_cuda
