// mpcomm.h - the MPComm provider API of mpcomm (libmpcomm.so.1).
//
// Mooncake's TENT reaches an MPComm provider through this API (its
// tent/src/transport/mpcomm/mpcomm_adapter.cpp); mpcomm implements it on top
// of its Python core, so TENT's MPCOMM transport moves data over every
// transport the node runs (shm, tcp, ucx, rdma).
//
// Addressing: raw virtual addresses on both sides. A local address must lie
// inside a range given to registerMemory(); a remote one inside a range the
// peer published (publishBuffer) as of the last queryRemoteBuffer() for that
// host. Anything else is refused before anything moves.
//
// Threading: every method may be called from many threads at once. The
// library embeds CPython: it initialises an interpreter once when the host
// process has none (the host then must not finalise it), and uses the running
// one otherwise. It holds the GIL only while calling into Python; polling
// (isTransferComplete, getTransferResult, releaseTransfer) never takes it, and
// waitTransfer() releases it while waiting. No exception crosses this API:
// every failure is a negative status code.
//
// Handles: putAsync/getAsync/scatterAsync/gatherAsync/broadcastAsync return a
// handle, or INVALID_TRANSFER_HANDLE (0) when nothing was issued
// (lastErrorCode() says why). Each valid handle is released exactly once; a
// released or unknown handle reports MPCOMM_ERR_INVALID_HANDLE, never crashes.
#ifndef MPCOMM_PROVIDER_MPCOMM_H
#define MPCOMM_PROVIDER_MPCOMM_H

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#define MPCOMM_VERSION_MAJOR 1
#define MPCOMM_VERSION_MINOR 4
#define MPCOMM_VERSION_PATCH 0

#if defined(__GNUC__)
#define MPCOMM_API __attribute__((visibility("default")))
#else
#define MPCOMM_API
#endif

namespace mpcomm {

// Status codes: 0 is success, every failure is negative. The same values as
// mpcomm.tent.codes in Python.
constexpr int MPCOMM_SUCCESS = 0;
constexpr int MPCOMM_ERR_GENERIC = -1;
constexpr int MPCOMM_ERR_INVALID_ARGUMENT = -2;
constexpr int MPCOMM_ERR_NOT_INITIALIZED = -3;
constexpr int MPCOMM_ERR_ALREADY_INITIALIZED = -4;
constexpr int MPCOMM_ERR_OUT_OF_RANGE = -5;    // outside every registered/published range
constexpr int MPCOMM_ERR_UNKNOWN_HOST = -6;    // no connect() for that host id
constexpr int MPCOMM_ERR_CONNECTION = -7;      // peer unreachable or gone
constexpr int MPCOMM_ERR_TIMEOUT = -8;
constexpr int MPCOMM_ERR_INVALID_HANDLE = -9;  // unknown or already released
constexpr int MPCOMM_ERR_PERMISSION = -10;
constexpr int MPCOMM_ERR_STALE = -11;          // peer restarted since the query
constexpr int MPCOMM_ERR_SHUTDOWN = -12;       // shut down while in flight
constexpr int MPCOMM_ERR_RUNTIME = -13;        // the embedded Python runtime failed
constexpr int MPCOMM_ERR_BUSY = -14;
constexpr int MPCOMM_ERR_IN_PROGRESS = -15;    // result asked for too early
constexpr int MPCOMM_ERR_CANCELLED = -16;
constexpr int MPCOMM_ERR_TRANSPORT = -17;

using TransferHandle = uint64_t;
constexpr TransferHandle INVALID_TRANSFER_HANDLE = 0;

struct TransferResult {
    int error_code = MPCOMM_ERR_INVALID_HANDLE;
    // Bytes moved; equals the request length when error_code is MPCOMM_SUCCESS.
    size_t bytes_transferred = 0;
};

struct RemoteBufferEntry {
    uint64_t addr = 0;
    uint64_t length = 0;
    int numa_node = -1;
    // mpcomm keeps each range's capability token inside the library; the
    // vector stays empty and is here for source compatibility.
    std::vector<uint32_t> rkeys;
};

struct RemoteBufferInfo {
    std::string host_id;
    std::vector<RemoteBufferEntry> buffers;
};

class MPCOMM_API MPComm {
   public:
    MPComm();
    ~MPComm();  // shuts down if still running
    MPComm(const MPComm &) = delete;
    MPComm &operator=(const MPComm &) = delete;

    // Starts the node; its handshake (control) endpoint listens on tcp_port
    // (0 picks a free one; getTcpPort() says which). device_names is accepted
    // and ignored: the core picks its transports (MPCOMM_TRANSPORTS narrows).
    int init(const std::string &host_id, const std::string &device_names,
             int tcp_port);
    int getTcpPort() const;
    // Peers can fetch this node's published buffers from here on.
    int startAcceptThread();
    int stopAcceptThread();
    // Aborts transfers in flight (their result becomes MPCOMM_ERR_SHUTDOWN),
    // closes the node. Handles stay valid until released.
    int shutdown();

    int registerMemory(void *addr, size_t length);
    int unregisterMemory(void *addr);
    int publishBuffer(void *addr, size_t length, int numa_node);
    int unpublishBuffer(void *addr);

    // Binds host_id to the peer at tcp_addr:tcp_port. A second connect for
    // the same host id replaces the record (its fetched keys included).
    int connect(const std::string &host_id, const std::string &tcp_addr,
                int tcp_port);
    // Fetches the peer's published buffers; replaces what was cached.
    int queryRemoteBuffer(const std::string &host_id,
                          const std::string &tcp_addr, int tcp_port,
                          RemoteBufferInfo &info);

    TransferHandle putAsync(uintptr_t local_addr, const std::string &host_id,
                            uintptr_t remote_addr, size_t length);
    TransferHandle getAsync(uintptr_t local_addr, const std::string &host_id,
                            uintptr_t remote_addr, size_t length);
    // Chunk i of [local_addr, local_addr + n*chunk) to host_ids[i] at
    // remote_addrs[i]; every request is checked before any is posted.
    TransferHandle scatterAsync(uintptr_t local_addr,
                                const std::vector<std::string> &host_ids,
                                const std::vector<uintptr_t> &remote_addrs,
                                size_t chunk);
    // chunk bytes from each host into consecutive chunks of the local buffer.
    TransferHandle gatherAsync(uintptr_t local_addr,
                               const std::vector<std::string> &host_ids,
                               const std::vector<uintptr_t> &remote_addrs,
                               size_t chunk);
    // The whole [local_addr, local_addr + length) to every host.
    TransferHandle broadcastAsync(uintptr_t local_addr,
                                  const std::vector<std::string> &host_ids,
                                  const std::vector<uintptr_t> &remote_addrs,
                                  size_t length);

    // True once terminal; true for an unknown or released handle too (there is
    // nothing to wait for; getTransferResult says MPCOMM_ERR_INVALID_HANDLE).
    bool isTransferComplete(TransferHandle handle);
    TransferResult getTransferResult(TransferHandle handle);
    // Waits (GIL released) up to timeout_ms (< 0: no limit); the result code,
    // or MPCOMM_ERR_TIMEOUT if the transfer is still running.
    int waitTransfer(TransferHandle handle, int timeout_ms);
    // MPCOMM_SUCCESS, or MPCOMM_ERR_INVALID_HANDLE for a second release.
    int releaseTransfer(TransferHandle handle);

    // The calling thread's last failure (code and message) from this library.
    static int lastErrorCode();
    static std::string lastErrorMessage();

    struct Impl;

   private:
    std::unique_ptr<Impl> impl_;
};

// The provider's version, "1.4.0".
MPCOMM_API const char *version();

}  // namespace mpcomm

#endif  // MPCOMM_PROVIDER_MPCOMM_H
