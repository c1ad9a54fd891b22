// A C++ host of mpcomm's MPComm provider, making the calls Mooncake TENT's
// mpcomm_adapter.cpp makes, in its order: init, getTcpPort,
// startAcceptThread, registerMemory + publishBuffer, connect,
// queryRemoteBuffer, putAsync/getAsync, isTransferComplete,
// getTransferResult, releaseTransfer, unpublishBuffer, unregisterMemory,
// stopAcceptThread, shutdown. Plus scatter/gather/broadcast and waitTransfer.
//
//   tent_host target HOST_ID PORT SIZE SEED
//       prints "READY port addr size", then serves stdin commands:
//       VERIFY dst_off len seed src_off | FILL seed | QUIT
//   tent_host initiator SIZE THREADS A_ID A_PORT A_ADDR B_ID B_PORT B_ADDR
//       runs the scenario; asks the driver for help with "REQ ..." lines
//       (answered on stdin) and prints "STEP name ok" / "FAIL ..." / "DONE".
//   tent_host bench A_ID A_PORT A_ADDR LEN ITERS
//       prints "BENCH us_per_op=..." for putAsync + poll + release.
//   tent_host dieput A_ID A_PORT A_ADDR LEN
//       puts LEN bytes to A over and over (two in flight), printing "PUTTING" after the first;
//       the driver kills A meanwhile. Prints "ERR code" for the first failed put and exits 0:
//       a dead peer is an error code, never SIGPIPE (the host's SIGPIPE stays at its default).
#ifdef TENT_HOST_EMBEDS_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <mpcomm.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace mpcomm;

namespace {

std::mutex g_out;

void say(const std::string &s) {
    std::lock_guard<std::mutex> l(g_out);
    std::cout << s << std::endl;
}

[[noreturn]] void fail(const std::string &what) {
    say("FAIL " + what + " (last error " + std::to_string(MPComm::lastErrorCode()) + ": " +
        MPComm::lastErrorMessage() + ")");
    std::exit(1);
}

#define CHECK(cond, what)      \
    do {                       \
        if (!(cond)) fail(what); \
    } while (0)

inline uint8_t pat(int seed, uint64_t i) { return static_cast<uint8_t>(i * 131 + seed * 7 + (i >> 9)); }

void fill(uint8_t *p, size_t n, int seed, uint64_t src_off = 0) {
    for (size_t i = 0; i < n; ++i) p[i] = pat(seed, src_off + i);
}

long firstBad(const uint8_t *p, size_t n, int seed, uint64_t src_off) {
    for (size_t i = 0; i < n; ++i)
        if (p[i] != pat(seed, src_off + i)) return static_cast<long>(i);
    return -1;
}

uint8_t *alloc(size_t n) {
    void *p = nullptr;
    if (posix_memalign(&p, 4096, n)) return nullptr;
    std::memset(p, 0, n);
    return static_cast<uint8_t *>(p);
}

std::string ask(const std::string &req) {
    say("REQ " + req);
    std::string line;
    if (!std::getline(std::cin, line)) fail("driver went away during " + req);
    return line;
}

void askOk(const std::string &req) {
    std::string r = ask(req);
    CHECK(r.rfind("OK", 0) == 0, req + " -> " + r);
}

// Issue, poll, check and release, as TENT's task mapping does.
void settle(MPComm &c, TransferHandle h, size_t len, const std::string &what) {
    CHECK(h != INVALID_TRANSFER_HANDLE, what + ": not issued");
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!c.isTransferComplete(h)) {
        CHECK(std::chrono::steady_clock::now() < deadline, what + ": no completion in 30 s");
        std::this_thread::yield();
    }
    TransferResult r = c.getTransferResult(h);
    CHECK(r.error_code == MPCOMM_SUCCESS, what + ": error " + std::to_string(r.error_code));
    CHECK(r.bytes_transferred == len, what + ": short transfer " + std::to_string(r.bytes_transferred));
    CHECK(c.releaseTransfer(h) == MPCOMM_SUCCESS, what + ": release");
}

int target(int argc, char **argv) {
    if (argc < 6) return 2;
    std::string host_id = argv[2];
    int port = std::atoi(argv[3]);
    size_t size = std::strtoull(argv[4], nullptr, 10);
    int seed = std::atoi(argv[5]);
    MPComm c;
    CHECK(c.init(host_id, "", port) == MPCOMM_SUCCESS, "target init");
    int bound = c.getTcpPort();
    CHECK(bound > 0, "target getTcpPort");
    CHECK(c.startAcceptThread() == MPCOMM_SUCCESS, "target startAcceptThread");
    uint8_t *buf = alloc(size);
    fill(buf, size, seed);
    CHECK(c.registerMemory(buf, size) == MPCOMM_SUCCESS, "target registerMemory");
    CHECK(c.publishBuffer(buf, size, -1) == MPCOMM_SUCCESS, "target publishBuffer");
    say("READY " + std::to_string(bound) + " " + std::to_string(reinterpret_cast<uintptr_t>(buf)) + " " +
        std::to_string(size));
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string cmd;
        in >> cmd;
        if (cmd == "VERIFY") {
            uint64_t off, len, src_off;
            int s;
            in >> off >> len >> s >> src_off;
            if (off + len > size) {
                say("BAD range");
                continue;
            }
            long bad = firstBad(buf + off, len, s, src_off);
            say(bad < 0 ? "OK" : "BAD at " + std::to_string(off + bad));
        } else if (cmd == "FILL") {
            int s;
            in >> s;
            fill(buf, size, s);
            say("OK");
        } else if (cmd == "QUIT") {
            break;
        }
    }
    c.unpublishBuffer(buf);
    c.unregisterMemory(buf);
    c.stopAcceptThread();
    c.shutdown();
    say("BYE");
    return 0;
}

int initiator(int argc, char **argv) {
    if (argc < 10) return 2;
    const size_t S = std::strtoull(argv[2], nullptr, 10);
    const int T = std::atoi(argv[3]);
    std::string A = argv[4], B = argv[7];
    int a_port = std::atoi(argv[5]), b_port = std::atoi(argv[8]);
    uintptr_t a_addr = std::strtoull(argv[6], nullptr, 10), b_addr = std::strtoull(argv[9], nullptr, 10);

    MPComm c;
    CHECK(c.init("127.0.0.1:initiator", "", 0) == MPCOMM_SUCCESS, "init");
    CHECK(c.init("127.0.0.1:initiator", "", 0) == MPCOMM_ERR_ALREADY_INITIALIZED, "second init refused");
    CHECK(c.getTcpPort() > 0, "getTcpPort");
    CHECK(c.startAcceptThread() == MPCOMM_SUCCESS, "startAcceptThread");
    uint8_t *src = alloc(S), *dst = alloc(S);
    CHECK(c.registerMemory(src, S) == MPCOMM_SUCCESS && c.publishBuffer(src, S, -1) == MPCOMM_SUCCESS, "register src");
    CHECK(c.registerMemory(dst, S) == MPCOMM_SUCCESS && c.publishBuffer(dst, S, -1) == MPCOMM_SUCCESS, "register dst");
    CHECK(c.registerMemory(src + 4096, 4096) != MPCOMM_SUCCESS, "overlapping registration refused");
    // Refused when registered, not at the first transfer: memory that is not mapped, a length past the end.
    CHECK(c.registerMemory(reinterpret_cast<void *>(0x1000), 4096) == MPCOMM_ERR_INVALID_ARGUMENT,
          "unmapped registration refused");
    uint8_t *small = alloc(4096);
    CHECK(c.registerMemory(small, size_t(1) << 62) == MPCOMM_ERR_INVALID_ARGUMENT, "length past the mapping refused");
    CHECK(c.registerMemory(small, SIZE_MAX) == MPCOMM_ERR_INVALID_ARGUMENT, "SIZE_MAX length refused");
    say("STEP init+register ok");

    RemoteBufferInfo info;
    CHECK(c.connect(A, "127.0.0.1", a_port) == MPCOMM_SUCCESS, "connect A");
    CHECK(c.queryRemoteBuffer(A, "127.0.0.1", a_port, info) == MPCOMM_SUCCESS, "query A");
    CHECK(info.buffers.size() == 1 && info.buffers[0].addr == a_addr && info.buffers[0].length == S, "A's buffers");
    // A second connect to the same host replaces the record; the query refreshes the keys.
    CHECK(c.connect(A, "127.0.0.1", a_port) == MPCOMM_SUCCESS, "second connect A");
    CHECK(c.queryRemoteBuffer(A, "127.0.0.1", a_port, info) == MPCOMM_SUCCESS, "query A again");
    CHECK(c.connect(B, "127.0.0.1", b_port) == MPCOMM_SUCCESS, "connect B");
    CHECK(c.queryRemoteBuffer(B, "127.0.0.1", b_port, info) == MPCOMM_SUCCESS && info.buffers.size() == 1 &&
              info.buffers[0].addr == b_addr, "query B");
    RemoteBufferInfo none;
    CHECK(c.connect("nobody", "127.0.0.1", 1) != MPCOMM_SUCCESS, "connect to a closed port fails");
    say("STEP connect+query ok");

    // Many putAsync from several threads, each keeping a window in flight.
    const size_t chunk = 64 << 10;
    const size_t nchunks = S / chunk;
    fill(src, S, 1);
    auto pump = [&](bool put) {
        std::vector<std::thread> ts;
        std::atomic<size_t> moved{0};
        for (int t = 0; t < T; ++t) {
            ts.emplace_back([&, t] {
                std::vector<std::pair<TransferHandle, size_t>> window;
                for (size_t j = t; j < nchunks; j += T) {
                    size_t off = j * chunk;
                    TransferHandle h = put ? c.putAsync(reinterpret_cast<uintptr_t>(src) + off, A, a_addr + off, chunk)
                                           : c.getAsync(reinterpret_cast<uintptr_t>(dst) + off, A, a_addr + off, chunk);
                    CHECK(h != INVALID_TRANSFER_HANDLE, "issue chunk");
                    window.emplace_back(h, off);
                    if (window.size() >= 8) {
                        settle(c, window.front().first, chunk, "chunk");
                        window.erase(window.begin());
                    }
                    moved += chunk;
                }
                for (auto &w : window) settle(c, w.first, chunk, "chunk");
            });
        }
        for (auto &th : ts) th.join();
        CHECK(moved == nchunks * chunk, "every chunk moved");
    };
    pump(true);
    askOk("VERIFY A 0 " + std::to_string(S) + " 1 0");
    say("STEP putAsync x" + std::to_string(nchunks) + " from " + std::to_string(T) + " threads ok");
    pump(false);
    CHECK(std::memcmp(src, dst, S) == 0, "getAsync bytes equal what was written");
    say("STEP getAsync ok");

    // Outside every published range: refused, nothing touched.
    CHECK(c.putAsync(reinterpret_cast<uintptr_t>(src), A, a_addr + S - 16, 64) == INVALID_TRANSFER_HANDLE &&
              MPComm::lastErrorCode() == MPCOMM_ERR_OUT_OF_RANGE, "remote range past the end refused");
    CHECK(c.putAsync(reinterpret_cast<uintptr_t>(src), A, 0x1000, 64) == INVALID_TRANSFER_HANDLE &&
              MPComm::lastErrorCode() == MPCOMM_ERR_OUT_OF_RANGE, "unpublished remote address refused");
    CHECK(c.getAsync(0x1000, A, a_addr, 64) == INVALID_TRANSFER_HANDLE &&
              MPComm::lastErrorCode() == MPCOMM_ERR_OUT_OF_RANGE, "unregistered local address refused");
    CHECK(c.putAsync(reinterpret_cast<uintptr_t>(src), "nobody", a_addr, 64) == INVALID_TRANSFER_HANDLE &&
              MPComm::lastErrorCode() == MPCOMM_ERR_UNKNOWN_HOST, "unknown host refused");
    askOk("VERIFY A 0 " + std::to_string(S) + " 1 0");
    say("STEP out-of-range refused, target untouched ok");

    // Handles are released exactly once.
    TransferHandle h = c.putAsync(reinterpret_cast<uintptr_t>(src), A, a_addr, 4096);
    CHECK(h != INVALID_TRANSFER_HANDLE && c.waitTransfer(h, 10000) == MPCOMM_SUCCESS, "waitTransfer");
    CHECK(c.releaseTransfer(h) == MPCOMM_SUCCESS, "release");
    CHECK(c.releaseTransfer(h) == MPCOMM_ERR_INVALID_HANDLE, "second release is an error");
    CHECK(c.isTransferComplete(h), "released handle reads as terminal");
    CHECK(c.getTransferResult(h).error_code == MPCOMM_ERR_INVALID_HANDLE, "released handle has no result");
    CHECK(c.waitTransfer(h, 0) == MPCOMM_ERR_INVALID_HANDLE, "wait on a released handle");
    CHECK(c.getTransferResult(987654321).error_code == MPCOMM_ERR_INVALID_HANDLE, "unknown handle");
    CHECK(c.releaseTransfer(0) == MPCOMM_ERR_INVALID_HANDLE, "handle 0");
    say("STEP released handle ok");

    // One local buffer to / from two hosts, one handle each.
    std::vector<std::string> hosts = {A, B};
    std::vector<uintptr_t> addrs = {a_addr, b_addr};
    fill(src, S, 2);
    h = c.scatterAsync(reinterpret_cast<uintptr_t>(src), hosts, addrs, S / 2);
    CHECK(h != INVALID_TRANSFER_HANDLE && c.waitTransfer(h, 20000) == MPCOMM_SUCCESS, "scatter");
    CHECK(c.getTransferResult(h).bytes_transferred == S, "scatter bytes");
    c.releaseTransfer(h);
    askOk("VERIFY A 0 " + std::to_string(S / 2) + " 2 0");
    askOk("VERIFY B 0 " + std::to_string(S / 2) + " 2 " + std::to_string(S / 2));
    say("STEP scatterAsync to two hosts ok");
    fill(src, S, 3);
    h = c.broadcastAsync(reinterpret_cast<uintptr_t>(src), hosts, addrs, S / 4);
    CHECK(h != INVALID_TRANSFER_HANDLE && c.waitTransfer(h, 20000) == MPCOMM_SUCCESS, "broadcast");
    c.releaseTransfer(h);
    askOk("VERIFY A 0 " + std::to_string(S / 4) + " 3 0");
    askOk("VERIFY B 0 " + std::to_string(S / 4) + " 3 0");
    say("STEP broadcastAsync to two hosts ok");
    std::memset(dst, 0, S);
    h = c.gatherAsync(reinterpret_cast<uintptr_t>(dst), hosts, addrs, S / 4);
    CHECK(h != INVALID_TRANSFER_HANDLE && c.waitTransfer(h, 20000) == MPCOMM_SUCCESS, "gather");
    c.releaseTransfer(h);
    CHECK(firstBad(dst, S / 4, 3, 0) < 0 && firstBad(dst + S / 4, S / 4, 3, 0) < 0, "gathered bytes");
    CHECK(c.scatterAsync(reinterpret_cast<uintptr_t>(src), hosts, {a_addr, 0x1000}, S / 2) == INVALID_TRANSFER_HANDLE,
          "scatter with one bad address refused as a whole");
    askOk("VERIFY A 0 " + std::to_string(S / 4) + " 3 0");
    say("STEP gatherAsync from two hosts ok");

    // A dead peer: an error within the deadline, never a hang or a crash.
    askOk("KILL B");
    auto t0 = std::chrono::steady_clock::now();
    h = c.putAsync(reinterpret_cast<uintptr_t>(src), B, b_addr, 4096);
    int code = h == INVALID_TRANSFER_HANDLE ? MPComm::lastErrorCode() : c.waitTransfer(h, 15000);
    if (h != INVALID_TRANSFER_HANDLE) c.releaseTransfer(h);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(code != MPCOMM_SUCCESS && code != MPCOMM_ERR_TIMEOUT, "dead peer -> error, got " + std::to_string(code));
    say("STEP dead peer -> " + std::to_string(code) + " in " + std::to_string(secs) + " s ok");

    // The peer comes back on the same port: reconnect, query, transfer.
    std::string r = ask("RESTART B");
    std::istringstream rin(r);
    std::string ok;
    uintptr_t nb_addr = 0;
    rin >> ok >> nb_addr;
    CHECK(ok == "OK" && nb_addr, "restart B -> " + r);
    CHECK(c.connect(B, "127.0.0.1", b_port) == MPCOMM_SUCCESS, "reconnect B");
    CHECK(c.queryRemoteBuffer(B, "127.0.0.1", b_port, info) == MPCOMM_SUCCESS && info.buffers.size() == 1 &&
              info.buffers[0].addr == nb_addr, "query restarted B");
    fill(src, S, 4);
    settle(c, c.putAsync(reinterpret_cast<uintptr_t>(src), B, nb_addr, S), S, "put to restarted B");
    askOk("VERIFY B 0 " + std::to_string(S) + " 4 0");
    say("STEP restarted peer reconnected ok");

    // Shutdown while transfers are in flight from other threads.
    std::vector<TransferHandle> inflight[2];
    std::atomic<bool> go{true};
    std::vector<std::thread> issuers;
    for (int t = 0; t < 2; ++t) {
        issuers.emplace_back([&, t] {
            for (int i = 0; i < 64 && go; ++i) {
                size_t off = (i % 8) * (S / 8);
                TransferHandle x = c.putAsync(reinterpret_cast<uintptr_t>(src) + off, A, a_addr + off, S / 8);
                if (x != INVALID_TRANSFER_HANDLE) inflight[t].push_back(x);
            }
        });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    CHECK(c.shutdown() == MPCOMM_SUCCESS, "shutdown");
    go = false;
    for (auto &th : issuers) th.join();
    size_t n_ok = 0, n_err = 0;
    for (auto &v : inflight)
        for (TransferHandle x : v) {
            CHECK(c.waitTransfer(x, 15000) != MPCOMM_ERR_TIMEOUT, "handle settles after shutdown");
            CHECK(c.isTransferComplete(x), "complete after shutdown");
            (c.getTransferResult(x).error_code == MPCOMM_SUCCESS ? n_ok : n_err)++;
            CHECK(c.releaseTransfer(x) == MPCOMM_SUCCESS, "release after shutdown");
        }
    CHECK(c.putAsync(reinterpret_cast<uintptr_t>(src), A, a_addr, 64) == INVALID_TRANSFER_HANDLE &&
              MPComm::lastErrorCode() == MPCOMM_ERR_NOT_INITIALIZED, "issue after shutdown refused");
    CHECK(c.shutdown() == MPCOMM_SUCCESS, "second shutdown is harmless");
    say("STEP shutdown with " + std::to_string(n_ok + n_err) + " in flight (" + std::to_string(n_ok) +
        " finished, " + std::to_string(n_err) + " aborted) ok");
    say("DONE");
    return 0;
}

int bench(int argc, char **argv) {
    if (argc < 7) return 2;
    std::string A = argv[2];
    int a_port = std::atoi(argv[3]);
    uintptr_t a_addr = std::strtoull(argv[4], nullptr, 10);
    size_t len = std::strtoull(argv[5], nullptr, 10);
    int iters = std::atoi(argv[6]);
    MPComm c;
    CHECK(c.init("127.0.0.1:bench", "", 0) == MPCOMM_SUCCESS, "init");
    uint8_t *src = alloc(len);
    CHECK(c.registerMemory(src, len) == MPCOMM_SUCCESS, "register");
    RemoteBufferInfo info;
    CHECK(c.connect(A, "127.0.0.1", a_port) == MPCOMM_SUCCESS, "connect");
    CHECK(c.queryRemoteBuffer(A, "127.0.0.1", a_port, info) == MPCOMM_SUCCESS, "query");
    for (int i = 0; i < 50; ++i) settle(c, c.putAsync(reinterpret_cast<uintptr_t>(src), A, a_addr, len), len, "warm");
    using clk = std::chrono::steady_clock;
    auto us = [](clk::duration d) { return std::chrono::duration<double, std::micro>(d).count(); };
    clk::duration issue{}, poll{}, rel{};
    long polls = 0;
    auto t0 = clk::now();
    for (int i = 0; i < iters; ++i) {
        auto a = clk::now();
        TransferHandle h = c.putAsync(reinterpret_cast<uintptr_t>(src), A, a_addr, len);
        auto b = clk::now();
        issue += b - a;
        for (;;) {
            auto p0 = clk::now();
            bool done = c.isTransferComplete(h);
            poll += clk::now() - p0;
            ++polls;
            if (done) break;
            std::this_thread::yield();  // a 2-core machine: leave the core to the completion thread
        }
        if (c.getTransferResult(h).error_code != MPCOMM_SUCCESS) fail("bench transfer");
        auto r0 = clk::now();
        c.releaseTransfer(h);
        rel += clk::now() - r0;
    }
    double total = us(clk::now() - t0) / iters;
    say("BENCH us_per_op=" + std::to_string(total) + " putAsync_us=" + std::to_string(us(issue) / iters) +
        " isTransferComplete_ns=" + std::to_string(us(poll) * 1000 / polls) + " releaseTransfer_ns=" +
        std::to_string(us(rel) * 1000 / iters) + " len=" + std::to_string(len) + " iters=" + std::to_string(iters));
    c.shutdown();
    return 0;
}

int dieput(int argc, char **argv) {
    if (argc < 6) return 2;
    std::string A = argv[2];
    int a_port = std::atoi(argv[3]);
    uintptr_t a_addr = std::strtoull(argv[4], nullptr, 10);
    size_t len = std::strtoull(argv[5], nullptr, 10);
    MPComm c;
    CHECK(c.init("127.0.0.1:dieput", "", 0) == MPCOMM_SUCCESS, "init");
    uint8_t *src = alloc(len);
    CHECK(src && c.registerMemory(src, len) == MPCOMM_SUCCESS, "register");
    RemoteBufferInfo info;
    CHECK(c.connect(A, "127.0.0.1", a_port) == MPCOMM_SUCCESS, "connect");
    CHECK(c.queryRemoteBuffer(A, "127.0.0.1", a_port, info) == MPCOMM_SUCCESS, "query");
    settle(c, c.putAsync(reinterpret_cast<uintptr_t>(src), A, a_addr, len), len, "first put");
    say("PUTTING");
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::vector<TransferHandle> window;
    while (std::chrono::steady_clock::now() < deadline) {
        TransferHandle h = c.putAsync(reinterpret_cast<uintptr_t>(src), A, a_addr, len);
        if (h == INVALID_TRANSFER_HANDLE) {
            say("ERR " + std::to_string(MPComm::lastErrorCode()));
            return 0;
        }
        window.push_back(h);
        if (window.size() < 2) continue;
        int code = c.waitTransfer(window.front(), 30000);
        c.releaseTransfer(window.front());
        window.erase(window.begin());
        if (code != MPCOMM_SUCCESS) {
            say("ERR " + std::to_string(code));
            for (TransferHandle x : window) {
                c.waitTransfer(x, 30000);
                c.releaseTransfer(x);
            }
            c.shutdown();
            return 0;
        }
    }
    fail("the peer never failed");
}

#ifdef TENT_HOST_EMBEDS_PYTHON
// A host that runs Python itself before touching the provider, and holds the
// GIL while it waits: the library must use this interpreter and let go of the
// GIL in waitTransfer, or the completion it waits for could never run.
int pyhost(int argc, char **argv) {
    if (argc < 3) return 2;
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0;
    PyConfig_SetBytesString(&config, &config.program_name, argv[2]);
    PyStatus st = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(st)) fail("host Py_Initialize");
    // The host imported the bridge module before the library created _mpcomm_native: the library
    // runs it again to get its entry point (mpcomm.cpp importBridge).
    CHECK(PyRun_SimpleString("import mpcomm, mpcomm.tent._bridge, sys; sys.host_marker = 42") == 0, "host runs Python");
    PyThreadState *main_state = PyEval_SaveThread();

    const size_t S = 1 << 20;
    MPComm a, b;
    CHECK(a.init("127.0.0.1:pa", "", 0) == MPCOMM_SUCCESS && a.startAcceptThread() == MPCOMM_SUCCESS, "a init");
    CHECK(b.init("127.0.0.1:pb", "", 0) == MPCOMM_SUCCESS, "b init");
    uint8_t *ta = alloc(S), *src = alloc(S);
    CHECK(a.registerMemory(ta, S) == MPCOMM_SUCCESS && a.publishBuffer(ta, S, -1) == MPCOMM_SUCCESS, "a register");
    CHECK(b.registerMemory(src, S) == MPCOMM_SUCCESS, "b register");
    RemoteBufferInfo info;
    CHECK(b.connect("A", "127.0.0.1", a.getTcpPort()) == MPCOMM_SUCCESS, "connect");
    CHECK(b.queryRemoteBuffer("A", "127.0.0.1", a.getTcpPort(), info) == MPCOMM_SUCCESS, "query");
    fill(src, S, 9);
    TransferHandle h = b.putAsync(reinterpret_cast<uintptr_t>(src), "A", reinterpret_cast<uintptr_t>(ta), S);
    CHECK(h != INVALID_TRANSFER_HANDLE, "put");
    {
        PyGILState_STATE g = PyGILState_Ensure();  // wait with the GIL held
        int code = b.waitTransfer(h, 20000);
        CHECK(code == MPCOMM_SUCCESS, "wait with the GIL held -> " + std::to_string(code));
        PyObject *globals = PyModule_GetDict(PyImport_AddModule("__main__"));  // borrowed
        PyObject *marker = PyRun_String("__import__('sys').host_marker", Py_eval_input, globals, globals);
        CHECK(marker && PyLong_AsLong(marker) == 42, "the library used the host's interpreter");
        Py_XDECREF(marker);
        PyGILState_Release(g);
    }
    b.releaseTransfer(h);
    CHECK(firstBad(ta, S, 9, 0) < 0, "bytes landed");
    b.shutdown();
    a.shutdown();
    PyEval_RestoreThread(main_state);
    say("DONE");
    return 0;
}
#endif

}  // namespace

int main(int argc, char **argv) {
    std::ios::sync_with_stdio(true);
    std::string role = argc > 1 ? argv[1] : "";
    if (role == "target") return target(argc, argv);
    if (role == "initiator") return initiator(argc, argv);
    if (role == "bench") return bench(argc, argv);
    if (role == "dieput") return dieput(argc, argv);
#ifdef TENT_HOST_EMBEDS_PYTHON
    if (role == "pyhost") return pyhost(argc, argv);
#endif
    std::fprintf(stderr, "usage: tent_host target|initiator|bench ...\n");
    return 2;
}
