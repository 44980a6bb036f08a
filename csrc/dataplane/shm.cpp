// Shared memory for the same-host transport: anonymous regions (memfd, 0600, sealed against
// resizing) that peers map through /proc/<pid>/fd/<fd> after checking they are regions of ours;
// and the one process setting a rank needs (its parent-death signal). Errors raise OSError (with
// errno and strerror) or ValueError.
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include <pybind11/pybind11.h>

#include "dataplane/api.h"
#include "common/mep_common.h"

namespace py = pybind11;

namespace mep {

namespace {

// The memfd name of every region (shown by the kernel as "/memfd:mep_region (deleted)").
constexpr const char* kRegionName = "mep_region";

// Raises OSError(errno, "<what>: <strerror>", name); errno picks the subclass
// (FileNotFoundError, PermissionError, ...). Called with the GIL held.
[[noreturn]] void raise_os_error(int err, const std::string& what, const std::string& name) {
    const std::string msg = what + ": " + std::strerror(err);
    PyErr_SetObject(PyExc_OSError, py::make_tuple(err, msg, name).ptr());
    throw py::error_already_set();
}

void check_size(int64_t nbytes) {
    if (nbytes <= 0) throw_value_error("nbytes = " + std::to_string(nbytes) + " must be > 0");
}

void* map_shared(int fd, int64_t nbytes) {
    void* p = mmap(nullptr, size_t(nbytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? nullptr : p;
}

const char* file_kind(mode_t mode) {
    switch (mode & S_IFMT) {
        case S_IFDIR: return "a directory";
        case S_IFCHR: return "a character device";
        case S_IFBLK: return "a block device";
        case S_IFIFO: return "a pipe";
        case S_IFSOCK: return "a socket";
        case S_IFLNK: return "a symbolic link";
        default: return "an unknown kind of file";
    }
}

}  // namespace

// ---- anonymous regions (memfd): no name ever exists, peers map them through /proc/<pid>/fd/<fd> ----

std::pair<int, uintptr_t> region_create(int64_t nbytes) {
    check_size(nbytes);
    const int fd = ::memfd_create(kRegionName, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) raise_os_error(errno, "memfd_create", "");
    auto fail = [&](const char* what) {
        const int err = errno;
        ::close(fd);
        raise_os_error(err, what, "memfd");
    };
    // 0600: only this user may open it through /proc (which also requires ptrace read access).
    if (::fchmod(fd, 0600) != 0) fail("fchmod");
    if (::ftruncate(fd, off_t(nbytes)) != 0) fail("ftruncate");
    // The size is final: nobody (a peer that opened it through /proc included) can shrink it under
    // a mapping (a SIGBUS in every mapper) or grow it; F_SEAL_SEAL keeps the seals as they are.
    // region_map_peer maps nothing that lacks these seals.
    if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) fail("fcntl(F_ADD_SEALS)");
    void* base = map_shared(fd, nbytes);
    if (!base) fail("mmap");
    return {fd, reinterpret_cast<uintptr_t>(base)};
}

uintptr_t region_map_peer(int64_t pid, int64_t fd, int64_t nbytes) {
    // pid and fd come from a peer (a store record): they only ever form a /proc/<pid>/fd/<fd>
    // path, and what that path names is mapped only if it is one of our regions: a memfd named
    // kRegionName, sealed against resizing, of exactly nbytes. Anything else the same user has
    // open (a regular file, a pipe, a memfd of another program) is refused before it is mapped.
    if (pid <= 0 || pid > (int64_t(1) << 22) || fd < 0 || fd > (int64_t(1) << 20)) {
        throw_value_error("peer region (pid " + std::to_string(pid) + ", fd " + std::to_string(fd) +
                          "): expected 0 < pid <= 4194304 and 0 <= fd <= 1048576");
    }
    check_size(nbytes);
    const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
    auto refuse = [&](const std::string& found) {
        throw_value_error("peer region " + path + " is not a region of mooncake_ep_switch: " + found +
                          " (expected a memfd '" + kRegionName + "' sealed against shrinking and growing)");
    };
    // Look before opening, so that opening has no side effect on what is not a regular file
    // (a device, a FIFO); the checks that count are made again on the opened descriptor.
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) raise_os_error(errno, "stat", path);
    if (!S_ISREG(st.st_mode)) refuse(std::string("not a regular file but ") + file_kind(st.st_mode));
    const int local = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (local < 0) raise_os_error(errno, "open", path);
    auto close_and = [&](auto&& thrower) {
        ::close(local);
        thrower();
    };
    if (::fstat(local, &st) != 0) {
        const int err = errno;
        close_and([&] { raise_os_error(err, "fstat", path); });
    }
    if (!S_ISREG(st.st_mode)) close_and([&] { refuse("not a regular file"); });
    const int seals = ::fcntl(local, F_GET_SEALS);
    if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
        // EINVAL: a file of a file system without seals (a regular file on disk).
        char what[96];
        if (seals < 0) {
            std::snprintf(what, sizeof(what), "a regular file that cannot be sealed (%s)", std::strerror(errno));
        } else {
            std::snprintf(what, sizeof(what), "a regular file not sealed against resizing (seals 0x%x)", unsigned(seals));
        }
        close_and([&] { refuse(what); });
    }
    // The name, read through our own descriptor (not the peer's fd slot, which could change meanwhile).
    char link[256];
    const std::string self_path = "/proc/self/fd/" + std::to_string(local);
    const ssize_t len = ::readlink(self_path.c_str(), link, sizeof(link) - 1);
    if (len < 0) {
        const int err = errno;
        close_and([&] { raise_os_error(err, "readlink", path); });
    }
    const std::string target(link, size_t(len));
    if (target != std::string("/memfd:") + kRegionName + " (deleted)") close_and([&] { refuse("'" + target + "'"); });
    if (int64_t(st.st_size) != nbytes) {
        close_and([&] {
            throw_value_error("peer region " + path + " has " + std::to_string(int64_t(st.st_size)) +
                              " bytes, expected nbytes = " + std::to_string(nbytes));
        });
    }
    void* base = map_shared(local, nbytes);
    const int err = errno;
    ::close(local);
    if (!base) raise_os_error(err, "mmap", path);
    return reinterpret_cast<uintptr_t>(base);
}

void region_close_fd(int64_t fd) {
    if (fd >= 0) ::close(int(fd));
}

void region_unmap(uintptr_t base, int64_t nbytes) {
    check_nonnull(base, "base");
    check_size(nbytes);
    if (::munmap(reinterpret_cast<void*>(base), size_t(nbytes)) != 0) raise_os_error(errno, "munmap", "");
}

void set_parent_death_signal(int64_t signal) {
    if (signal < 0 || signal > 64) throw_value_error("signal must be in [0, 64], got " + std::to_string(signal));
    if (::prctl(PR_SET_PDEATHSIG, static_cast<unsigned long>(signal)) != 0) raise_os_error(errno, "prctl", "");
}

void enter_net_namespace(int64_t fd) {
    if (fd < 0 || fd > INT32_MAX) throw_value_error("fd must be an open file descriptor, got " + std::to_string(fd));
    if (::setns(int(fd), CLONE_NEWNET) != 0) raise_os_error(errno, "setns", "");
}

void copy_bytes(uintptr_t dst, uintptr_t src, int64_t nbytes) {
    check_nonnull(dst, "dst");
    check_nonnull(src, "src");
    check_size(nbytes);
    std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), size_t(nbytes));
}

std::pair<int64_t, int64_t> malloc_bytes() {
    const struct mallinfo2 info = ::mallinfo2();
    return {int64_t(info.uordblks + info.hblkhd), int64_t(info.fordblks)};
}

}  // namespace mep
