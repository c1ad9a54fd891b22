// Drives Mooncake TENT's own MPComm boundary (LibMpcommAdapter, compiled from
// a Mooncake checkout's tent/src/transport/mpcomm/mpcomm_adapter.cpp with
// -DUSE_MPCOMM against mpcomm's include/mpcomm.h) over mpcomm's libmpcomm.so,
// the way MpcommTransport uses it. Nothing of Mooncake's is in this file: it
// only includes the adapter's public header from the checkout.
//
//   mooncake_adapter_driver A_ID A_PORT A_ADDR SIZE
// against a tent_host target; prints "STEP ... ok" lines and "DONE".
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "tent/transport/mpcomm/mpcomm_adapter.h"

using mooncake::tent::createDefaultMpcommAdapter;
using mooncake::tent::kInvalidMpcommTransferHandle;
using mooncake::tent::MpcommTransferHandle;

#define CHECK(cond, what)                              \
    do {                                               \
        if (!(cond)) {                                 \
            std::cout << "FAIL " << (what) << std::endl; \
            std::exit(1);                              \
        }                                              \
    } while (0)

int main(int argc, char **argv) {
    if (argc < 5) return 2;
    std::string A = argv[1];
    int a_port = std::atoi(argv[2]);
    uintptr_t a_addr = std::strtoull(argv[3], nullptr, 10);
    size_t S = std::strtoull(argv[4], nullptr, 10);

    auto adapter = createDefaultMpcommAdapter();
    CHECK(adapter->available(), "the adapter was built with the provider");
    auto st = adapter->init("127.0.0.1:mooncake-driver", "", 0);
    CHECK(st.ok(), "init: " + st.ToString());
    CHECK(adapter->tcpPort() > 0, "tcpPort");
    CHECK(adapter->startAcceptThread().ok(), "startAcceptThread");
    std::vector<uint8_t> src(S), dst(S);
    // tent_host's pattern with seed 6, so the target can check what landed.
    for (size_t i = 0; i < S; ++i) src[i] = static_cast<uint8_t>(i * 131 + 6 * 7 + (i >> 9));
    CHECK(adapter->registerMemory(src.data(), S).ok() && adapter->publishBuffer(src.data(), S, -1).ok(), "src");
    CHECK(adapter->registerMemory(dst.data(), S).ok() && adapter->publishBuffer(dst.data(), S, -1).ok(), "dst");
    std::cout << "STEP install+addMemoryBuffer ok" << std::endl;

    st = adapter->connect(A, "127.0.0.1", a_port);
    CHECK(st.ok(), "connect: " + st.ToString());
    CHECK(adapter->queryRemoteBuffer(A, "127.0.0.1", a_port).ok(), "queryRemoteBuffer");
    std::cout << "STEP connect+query ok" << std::endl;

    const size_t chunk = 64 << 10;
    auto run = [&](bool write) {
        std::vector<std::thread> ts;
        std::atomic<int> bad{0};
        for (int t = 0; t < 4; ++t) {
            ts.emplace_back([&, t] {
                for (size_t off = t * chunk; off < S; off += 4 * chunk) {
                    uintptr_t local = reinterpret_cast<uintptr_t>(write ? src.data() : dst.data()) + off;
                    MpcommTransferHandle h = write ? adapter->putAsync(local, A, a_addr + off, chunk)
                                                   : adapter->getAsync(local, A, a_addr + off, chunk);
                    if (h == kInvalidMpcommTransferHandle) {
                        ++bad;
                        continue;
                    }
                    while (!adapter->isTransferComplete(h)) std::this_thread::yield();
                    auto o = adapter->getTransferResult(h);
                    if (!o.ok || o.bytes_transferred != chunk) ++bad;
                    adapter->releaseTransfer(h);
                }
            });
        }
        for (auto &th : ts) th.join();
        return bad.load();
    };
    CHECK(run(true) == 0, "putAsync through the adapter");
    CHECK(run(false) == 0, "getAsync through the adapter");
    CHECK(std::memcmp(src.data(), dst.data(), S) == 0, "bytes read back equal bytes written");
    std::cout << "STEP put/get from 4 threads, every byte ok" << std::endl;

    CHECK(adapter->putAsync(reinterpret_cast<uintptr_t>(src.data()), A, a_addr + S, 64) ==
              kInvalidMpcommTransferHandle, "outside every published range -> not issued");
    MpcommTransferHandle h = adapter->putAsync(reinterpret_cast<uintptr_t>(src.data()), A, a_addr, 64);
    CHECK(h != kInvalidMpcommTransferHandle, "one more put");
    while (!adapter->isTransferComplete(h)) std::this_thread::yield();
    adapter->releaseTransfer(h);
    adapter->releaseTransfer(h);  // a second release must not crash
    auto o = adapter->getTransferResult(h);
    CHECK(!o.ok && o.native_status != 0, "a released handle reports a provider error");
    std::cout << "STEP refusals and a released handle ok (native_status " << o.native_status << ")" << std::endl;

    adapter->unpublishBuffer(dst.data());
    adapter->unregisterMemory(dst.data());
    adapter->unpublishBuffer(src.data());
    adapter->unregisterMemory(src.data());
    adapter->stopAcceptThread();
    adapter->shutdown();
    CHECK(adapter->putAsync(reinterpret_cast<uintptr_t>(src.data()), A, a_addr, 64) == kInvalidMpcommTransferHandle,
          "after shutdown nothing is issued");
    adapter->shutdown();  // teardown is idempotent
    std::cout << "STEP uninstall ok" << std::endl << "DONE" << std::endl;
    return 0;
}
