// The table libmpcomm.so.1 calls (mpcomm_abi.h): each entry forwards to the
// MPComm of mpcomm.cpp, compiled into the same library under the namespace
// mpcomm_impl (-Dmpcomm=mpcomm_impl, see tent/build.py).
#include <string>

#include "mpcomm.h"
#include "mpcomm_abi.h"

namespace mpcomm {
extern std::string defaultPython;  // mpcomm.cpp: the interpreter to start when no MPCOMM_PYTHON is set
}

namespace {

using mpcomm::MPComm;

MPComm *self(void *obj) { return static_cast<MPComm *>(obj); }

const MpcommImplTable kTable = {
    MPCOMM_IMPL_ABI,
    [](const char *path) { mpcomm::defaultPython = path ? path : ""; },
    []() -> void * { return new (std::nothrow) MPComm(); },
    [](void *obj) { delete self(obj); },
    [](void *obj, const std::string &h, const std::string &d, int p) { return self(obj)->init(h, d, p); },
    [](void *obj) { return self(obj)->getTcpPort(); },
    [](void *obj) { return self(obj)->startAcceptThread(); },
    [](void *obj) { return self(obj)->stopAcceptThread(); },
    [](void *obj) { return self(obj)->shutdown(); },
    [](void *obj, void *a, size_t n) { return self(obj)->registerMemory(a, n); },
    [](void *obj, void *a) { return self(obj)->unregisterMemory(a); },
    [](void *obj, void *a, size_t n, int numa) { return self(obj)->publishBuffer(a, n, numa); },
    [](void *obj, void *a) { return self(obj)->unpublishBuffer(a); },
    [](void *obj, const std::string &h, const std::string &addr, int p) { return self(obj)->connect(h, addr, p); },
    [](void *obj, const std::string &h, const std::string &addr, int p, void *info) {
        return self(obj)->queryRemoteBuffer(h, addr, p, *static_cast<mpcomm::RemoteBufferInfo *>(info));
    },
    [](void *obj, uintptr_t l, const std::string &h, uintptr_t r, size_t n) -> uint64_t {
        return self(obj)->putAsync(l, h, r, n);
    },
    [](void *obj, uintptr_t l, const std::string &h, uintptr_t r, size_t n) -> uint64_t {
        return self(obj)->getAsync(l, h, r, n);
    },
    [](void *obj, int kind, uintptr_t l, const std::vector<std::string> &hs, const std::vector<uintptr_t> &rs,
       size_t n) -> uint64_t {
        if (kind == 0) return self(obj)->scatterAsync(l, hs, rs, n);
        if (kind == 1) return self(obj)->gatherAsync(l, hs, rs, n);
        return self(obj)->broadcastAsync(l, hs, rs, n);
    },
    [](void *obj, uint64_t h) { return self(obj)->isTransferComplete(h); },
    [](void *obj, uint64_t h, void *out) {
        *static_cast<mpcomm::TransferResult *>(out) = self(obj)->getTransferResult(h);
    },
    [](void *obj, uint64_t h, int ms) { return self(obj)->waitTransfer(h, ms); },
    [](void *obj, uint64_t h) { return self(obj)->releaseTransfer(h); },
    []() { return MPComm::lastErrorCode(); },
    []() { return MPComm::lastErrorMessage(); },
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const MpcommImplTable *mpcomm_impl_table() { return &kTable; }
