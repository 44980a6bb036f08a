#include "sockets/inbound_reaper.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace mep {
namespace {

// Inodes of sockets in this network namespace whose local port is `port` and that are not listening.
// /proc/net/tcp{,6} rows: "sl local_address rem_address st ... uid timeout inode ..." (hex, kernel order).
void connected_on_port(int port, std::unordered_set<unsigned long>& inodes) {
    for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
        FILE* file = std::fopen(table, "re");
        if (!file) continue;
        char line[512];
        bool header = true;
        while (std::fgets(line, sizeof(line), file)) {
            if (header) { header = false; continue; }
            char local[64], remote[64];
            unsigned state = 0;
            unsigned long inode = 0;
            // sl: local rem st tx:rx tr:when retrnsmt uid timeout inode
            if (std::sscanf(line, " %*s %63s %63s %x %*s %*s %*s %*s %*s %lu", local, remote, &state, &inode) != 4)
                continue;
            const char* colon = std::strrchr(local, ':');
            if (!colon || state == 0x0A /* LISTEN */ || inode == 0) continue;
            if (static_cast<int>(std::strtol(colon + 1, nullptr, 16)) == port) inodes.insert(inode);
        }
        std::fclose(file);
    }
}

}  // namespace

int64_t shutdown_inbound(int64_t port) {
    if (port <= 0 || port >= 65536) throw std::invalid_argument("port must be in (0, 65536), got " + std::to_string(port));
    std::unordered_set<unsigned long> inodes;
    connected_on_port(static_cast<int>(port), inodes);
    if (inodes.empty()) return 0;
    DIR* dir = opendir("/proc/self/fd");
    if (!dir) return 0;
    int64_t count = 0;
    while (dirent* entry = readdir(dir)) {
        char* end = nullptr;
        const long fd = std::strtol(entry->d_name, &end, 10);
        if (end == entry->d_name || *end != '\0') continue;
        // A dup pins the socket: if `fd` was closed and reused meanwhile, the inode no longer matches.
        const int pinned = fcntl(static_cast<int>(fd), F_DUPFD_CLOEXEC, 0);
        if (pinned < 0) continue;
        struct stat info;
        if (fstat(pinned, &info) == 0 && S_ISSOCK(info.st_mode) && inodes.count(info.st_ino)) {
            if (shutdown(pinned, SHUT_RDWR) == 0) ++count;
        }
        close(pinned);  // only the dup: the engine still owns and closes its descriptor
    }
    closedir(dir);
    return count;
}

InboundReaper::InboundReaper(int64_t port, double period_s) {
    if (port <= 0 || port >= 65536) throw std::invalid_argument("port must be in (0, 65536), got " + std::to_string(port));
    if (!(period_s > 0.0 && period_s <= 10.0))
        throw std::invalid_argument("period_s must be in (0, 10], got " + std::to_string(period_s));
    port_ = static_cast<int>(port);
    period_us_ = static_cast<int64_t>(period_s * 1e6);
    thread_ = std::thread([this] { run(); });
}

InboundReaper::~InboundReaper() { stop(); }

int64_t InboundReaper::stop() {
    running_.store(false);
    if (thread_.joinable()) thread_.join();
    return aborted_.load();
}

void InboundReaper::run() {
    while (running_.load()) {
        aborted_ += shutdown_inbound(port_);
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(period_us_);
        while (running_.load() && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
}

}  // namespace mep
