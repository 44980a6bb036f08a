#include "sockets/inbound_reaper.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace mep {
namespace {

void check_port(int64_t port) {
    if (port <= 0 || port >= 65536) throw std::invalid_argument("port must be in (0, 65536), got " + std::to_string(port));
}

// The inode of a "socket:[<inode>]" link target, or 0 for anything else (a file, a pipe, ...).
unsigned long socket_inode(const char* name) {
    char path[64], target[64];
    std::snprintf(path, sizeof(path), "/proc/self/fd/%s", name);
    const ssize_t n = readlink(path, target, sizeof(target) - 1);  // never opens the file
    if (n <= 0) return 0;
    target[n] = '\0';
    if (std::strncmp(target, "socket:[", 8) != 0) return 0;
    return std::strtoul(target + 8, nullptr, 10);
}

// Whether the socket `fd` is a connected (not listening) TCP/IP socket whose local port is `port`.
bool connected_on_port(int fd, int port) {
    int listening = 0;
    socklen_t size = sizeof(listening);
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &size) != 0 || listening) return false;
    int type = 0;
    size = sizeof(type);
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &size) != 0 || type != SOCK_STREAM) return false;
    sockaddr_storage local;
    size = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &size) != 0) return false;
    if (local.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port) == port;
    if (local.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port) == port;
    return false;
}

}  // namespace

int64_t shutdown_inbound(int64_t port) {
    check_port(port);
    DIR* dir = opendir("/proc/self/fd");
    if (!dir) return 0;
    int64_t count = 0;
    while (dirent* entry = readdir(dir)) {
        char* end = nullptr;
        const long fd = std::strtol(entry->d_name, &end, 10);
        if (end == entry->d_name || *end != '\0') continue;
        const unsigned long inode = socket_inode(entry->d_name);
        if (inode == 0) continue;  // only sockets are ever duplicated (closing a dup of a file drops its locks)
        // A dup pins the socket: if `fd` was closed and reused meanwhile, the inode no longer matches.
        const int pinned = fcntl(static_cast<int>(fd), F_DUPFD_CLOEXEC, 0);
        if (pinned < 0) continue;
        struct stat info;
        if (fstat(pinned, &info) == 0 && S_ISSOCK(info.st_mode) && info.st_ino == inode &&
            connected_on_port(pinned, static_cast<int>(port))) {
            if (shutdown(pinned, SHUT_RDWR) == 0) ++count;
        }
        close(pinned);  // only the dup: the engine still owns and closes its descriptor
    }
    closedir(dir);
    return count;
}

namespace {

// The first line of a small /proc file, without its newline ("" if unreadable).
std::string first_line(const std::string& path) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return "";
    char text[256];
    const ssize_t n = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (n <= 0) return "";
    std::string line(text, static_cast<size_t>(n));
    const size_t cut = line.find('\n');
    return cut == std::string::npos ? line : line.substr(0, cut);
}

}  // namespace

std::string thread_report(int64_t max_threads) {
    if (max_threads <= 0 || max_threads > 4096)
        throw std::invalid_argument("max_threads must be in (0, 4096], got " + std::to_string(max_threads));
    DIR* dir = opendir("/proc/self/task");
    if (!dir) return "";
    std::string report;
    int64_t lines = 0, skipped = 0;
    while (dirent* entry = readdir(dir)) {
        if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
        if (lines >= max_threads) { ++skipped; continue; }
        const std::string task = std::string("/proc/self/task/") + entry->d_name;
        std::string syscall = first_line(task + "/syscall");
        const size_t space = syscall.find(' ');  // "<nr> <args...>": the number says enough
        if (space != std::string::npos) syscall = syscall.substr(0, space);
        report += std::string(entry->d_name) + " " + first_line(task + "/comm") + " wchan=" +
                  first_line(task + "/wchan") + " syscall=" + syscall + "\n";
        ++lines;
    }
    closedir(dir);
    if (skipped) report += "(" + std::to_string(skipped) + " more threads)\n";
    return report;
}

InboundReaper::InboundReaper(int64_t port, double period_s, double max_s, double report_after_s) {
    check_port(port);
    if (!(period_s > 0.0 && period_s <= 10.0))
        throw std::invalid_argument("period_s must be in (0, 10], got " + std::to_string(period_s));
    if (!(max_s > 0.0 && max_s <= 86400.0))
        throw std::invalid_argument("max_s must be in (0, 86400], got " + std::to_string(max_s));
    if (!(report_after_s >= 0.0 && report_after_s <= 86400.0))
        throw std::invalid_argument("report_after_s must be in [0, 86400], got " + std::to_string(report_after_s));
    port_ = static_cast<int>(port);
    report_us_ = static_cast<int64_t>(report_after_s * 1e6);
    period_us_ = static_cast<int64_t>(period_s * 1e6);
    max_us_ = static_cast<int64_t>(max_s * 1e6);
    thread_ = std::thread([this] { run(); });
}

InboundReaper::~InboundReaper() { stop(); }

int64_t InboundReaper::stop() {
    std::lock_guard<std::mutex> guard(stop_mutex_);
    running_.store(false);
    if (thread_.joinable()) thread_.join();
    return aborted_.load();
}

void InboundReaper::run() {
    const auto start = std::chrono::steady_clock::now();
    const auto end = start + std::chrono::microseconds(max_us_);
    while (running_.load() && std::chrono::steady_clock::now() < end) {
        aborted_ += shutdown_inbound(port_);
        if (report_us_ > 0 && !reported_.load() &&
            std::chrono::steady_clock::now() - start >= std::chrono::microseconds(report_us_)) {
            // Once: the engine is still not destroyed; say what each thread waits in (stderr, unbuffered).
            char head[192];
            std::snprintf(head, sizeof(head),
                          "mooncake_ep_switch: the Transfer Engine behind handshake port %d is still not destroyed "
                          "%.1f s after close(); this process's threads (tid name wchan syscall):\n",
                          port_, report_us_ / 1e6);
            const std::string text = head + thread_report(256);
            const ssize_t ignored = write(2, text.data(), text.size());
            (void)ignored;
            reported_.store(true);
        }
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(period_us_);
        while (running_.load() && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
}

}  // namespace mep
