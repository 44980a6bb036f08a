// CUDA runtime plumbing for the device data plane: device and mapped host memory, IPC handles,
// synchronous copies for membership changes. Errors become std::runtime_error (RuntimeError in
// Python) naming the call and the runtime's message.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/api.h"
#include "cuda/check.h"

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

void stream_synchronize(uintptr_t stream) {
    check(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

}  // namespace mep_cuda
