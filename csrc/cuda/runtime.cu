// CUDA runtime plumbing for the device data plane: device and mapped host memory, IPC handles,
// synchronous copies for membership changes. Errors become std::runtime_error (RuntimeError in
// Python) naming the call and the runtime's message.
#include <cuda.h>  // driver types only: the driver's functions are reached through the runtime (no libcuda link)
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda/api.h"
#include "cuda/check.h"
#include "cuda/copy_kernels.cuh"

namespace mep_cuda {

int device_count() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky-free error so later calls start clean
        return 0;
    }
    return count;
}

std::string device_status() {
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) {
        cudaGetLastError();
        return cudaGetErrorString(status);
    }
    return count > 0 ? "" : "no CUDA device";
}

int current_device() {
    int device = -1;
    check(cudaGetDevice(&device), "cudaGetDevice");
    return device;
}

uintptr_t device_alloc(int64_t nbytes, int device) {
    if (nbytes <= 0) throw std::invalid_argument("nbytes: expected > 0, got " + std::to_string(nbytes));
    check(cudaSetDevice(device), "cudaSetDevice");
    void* ptr = nullptr;
    check(cudaMalloc(&ptr, size_t(nbytes)), "cudaMalloc");
    const cudaError_t zeroed = cudaMemset(ptr, 0, size_t(nbytes));
    if (zeroed != cudaSuccess) {
        cudaFree(ptr);
        check(zeroed, "cudaMemset");
    }
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    return reinterpret_cast<uintptr_t>(ptr);
}

void device_free(uintptr_t ptr) {
    if (ptr) check(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree");
}

uintptr_t mapped_host_alloc(int64_t nbytes) {
    if (nbytes <= 0) throw std::invalid_argument("nbytes: expected > 0, got " + std::to_string(nbytes));
    void* ptr = nullptr;
    check(cudaHostAlloc(&ptr, size_t(nbytes), cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
    std::memset(ptr, 0, size_t(nbytes));
    return reinterpret_cast<uintptr_t>(ptr);
}

void mapped_host_free(uintptr_t ptr) {
    if (ptr) check(cudaFreeHost(reinterpret_cast<void*>(ptr)), "cudaFreeHost");
}

std::string ipc_handle(uintptr_t ptr) {
    cudaIpcMemHandle_t handle;
    check(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(ptr)), "cudaIpcGetMemHandle");
    return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

uintptr_t ipc_open(const std::string& bytes, int device) {
    cudaIpcMemHandle_t handle;
    if (bytes.size() != sizeof(handle))
        throw std::invalid_argument("handle: expected " + std::to_string(sizeof(handle)) + " bytes, got " +
                                    std::to_string(bytes.size()));
    std::memcpy(&handle, bytes.data(), sizeof(handle));
    check(cudaSetDevice(device), "cudaSetDevice");
    void* ptr = nullptr;
    check(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    return reinterpret_cast<uintptr_t>(ptr);
}

int64_t allocation_bytes(uintptr_t ptr) {
    using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    static GetRange get_range = nullptr;
    if (!get_range) {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        check(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found),
              "cudaGetDriverEntryPointByVersion(cuMemGetAddressRange)");
        if (found != cudaDriverEntryPointSuccess || !fn)
            throw std::runtime_error("cuMemGetAddressRange: not provided by this driver");
        get_range = reinterpret_cast<GetRange>(fn);
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    const CUresult status = get_range(&base, &size, CUdeviceptr(ptr));
    if (status != CUDA_SUCCESS) throw std::runtime_error("cuMemGetAddressRange: error " + std::to_string(int(status)));
    return int64_t(uintptr_t(base) + size - ptr);
}

void ipc_close(uintptr_t ptr) {
    if (ptr) check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle");
}

void copy_to_device(uintptr_t dst, uintptr_t src, int64_t nbytes) {
    check(cudaMemcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), size_t(nbytes),
                     cudaMemcpyHostToDevice),
          "cudaMemcpy (to device)");
}

void copy_to_host(uintptr_t dst, uintptr_t src, int64_t nbytes) {
    check(cudaMemcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), size_t(nbytes),
                     cudaMemcpyDeviceToHost),
          "cudaMemcpy (to host)");
}

namespace {

// One end of a block (rows of row_bytes at stride from start) inside [lo, hi), or a message saying why not.
std::string block_outside(int64_t index, const char* side, uintptr_t start, int64_t rows, int64_t row_bytes,
                          int64_t stride, uintptr_t lo, uintptr_t hi) {
    const std::string name = "copy_blocks_async: block " + std::to_string(index) + " " + side;
    if (rows < 0 || row_bytes < 0 || stride < 0) return name + " has a negative rows/row_bytes/stride";
    if (rows == 0 || row_bytes == 0) return "";
    if (rows > 1 && stride < row_bytes) return name + " stride " + std::to_string(stride) + " < row_bytes";
    int64_t span = 0;
    uintptr_t end = 0;
    if (__builtin_mul_overflow(rows - 1, stride, &span) || __builtin_add_overflow(span, row_bytes, &span) ||
        __builtin_add_overflow(start, uintptr_t(span), &end))
        return name + " extent overflows";
    if (start < lo || end > hi)
        return name + " [" + std::to_string(start) + ", " + std::to_string(end) + ") is outside its region [" +
               std::to_string(lo) + ", " + std::to_string(hi) + ")";
    return "";
}


}  // namespace

// The largest pitch cudaMemcpy2DAsync takes on current GPUs (cudaDevAttrMaxPitch); the Python side sends calls with
// larger strides to the kernel (device_region.MAX_RUNTIME_PITCH), this is the fallback for any other caller.
constexpr int64_t kMaxCopyPitch = 2147483647;

int64_t copy_blocks_async(uintptr_t desc_ptr, int64_t n, uintptr_t dst_lo, uintptr_t dst_hi, uintptr_t src_lo,
                          uintptr_t src_hi, uintptr_t stream, uintptr_t device_desc) {
    if (n < 0) throw std::invalid_argument("copy_blocks_async: n = " + std::to_string(n) + " must be >= 0");
    if (n > 0 && !desc_ptr) throw std::invalid_argument("copy_blocks_async: desc_ptr is null");
    const int64_t* desc = reinterpret_cast<const int64_t*>(desc_ptr);
    for (int64_t i = 0; i < n; ++i) {  // every block checked before the first copy is queued
        const int64_t* d = desc + 6 * i;
        std::string why = block_outside(i, "destination", uintptr_t(d[0]), d[2], d[3], d[4], dst_lo, dst_hi);
        if (why.empty()) why = block_outside(i, "source", uintptr_t(d[1]), d[2], d[3], d[5], src_lo, src_hi);
        if (!why.empty()) throw std::invalid_argument(why);
    }
    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const CopyTotals totals = copy_totals(desc, n);
    int64_t total = totals.bytes;
    if (device_desc && total > 0) {
        // The table goes to the device on the same stream (a later call's table is written only after this
        // kernel read it), then one launch.
        check(cudaMemcpyAsync(reinterpret_cast<void*>(device_desc), desc, size_t(n) * 6 * sizeof(int64_t),
                              cudaMemcpyHostToDevice, s),
              "cudaMemcpyAsync (copy table)");
        cudaGetLastError();  // an earlier, unrelated launch error is not this kernel's
        launch_copy_blocks(reinterpret_cast<const int64_t*>(device_desc), n, totals.max_pieces, s);
        return total;
    }
    total = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t* d = desc + 6 * i;
        int64_t rows = d[2], width = d[3];
        if (rows == 0 || width == 0) continue;
        void* dst = reinterpret_cast<void*>(uintptr_t(d[0]));
        const void* src = reinterpret_cast<const void*>(uintptr_t(d[1]));
        total += rows * width;
        if (rows > 1 && (d[4] > kMaxCopyPitch || d[5] > kMaxCopyPitch)) {  // past a 2D copy's pitch: row by row
            for (int64_t r = 0; r < rows; ++r)
                check(cudaMemcpyAsync(static_cast<char*>(dst) + r * d[4], static_cast<const char*>(src) + r * d[5],
                                      size_t(width), cudaMemcpyDefault, s),
                      "cudaMemcpyAsync (row)");
        } else if (rows > 1 && (d[4] != width || d[5] != width)) {
            check(cudaMemcpy2DAsync(dst, size_t(d[4]), src, size_t(d[5]), size_t(width), size_t(rows),
                                    cudaMemcpyDefault, s),
                  "cudaMemcpy2DAsync");
        } else {  // one contiguous run
            check(cudaMemcpyAsync(dst, src, size_t(rows * width), cudaMemcpyDefault, s), "cudaMemcpyAsync");
        }
    }
    return total;
}

void stream_synchronize(uintptr_t stream) {
    check(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

}  // namespace mep_cuda
