// The private table between libmpcomm.so.1 (mpcomm_front.cpp: no Python) and
// libmpcomm_python<X.Y>.so (mpcomm.cpp + mpcomm_impl_entry.cpp: the Python
// runtime). Not installed: only these two libraries, built together by
// tent/build.py from one mpcomm.h, use it. The implementation library is
// compiled with -Dmpcomm=mpcomm_impl so that its classes never collide with
// the front's; the structs passed by pointer (RemoteBufferInfo,
// TransferResult) come from the same header, so their layouts are the same.
#ifndef MPCOMM_PROVIDER_ABI_H
#define MPCOMM_PROVIDER_ABI_H

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#define MPCOMM_IMPL_ABI 1
#define MPCOMM_IMPL_TABLE_SYMBOL "mpcomm_impl_table"

extern "C" {

struct MpcommImplTable {
    int abi;  // MPCOMM_IMPL_ABI
    // The interpreter to start when the host runs no Python (what the front chose and loaded).
    void (*set_python)(const char *path);
    void *(*create)();
    void (*destroy)(void *obj);
    int (*init)(void *obj, const std::string &host_id, const std::string &device_names, int tcp_port);
    int (*get_tcp_port)(void *obj);
    int (*start_accept)(void *obj);
    int (*stop_accept)(void *obj);
    int (*shutdown)(void *obj);
    int (*register_memory)(void *obj, void *addr, size_t length);
    int (*unregister_memory)(void *obj, void *addr);
    int (*publish)(void *obj, void *addr, size_t length, int numa_node);
    int (*unpublish)(void *obj, void *addr);
    int (*connect)(void *obj, const std::string &host_id, const std::string &tcp_addr, int tcp_port);
    int (*query)(void *obj, const std::string &host_id, const std::string &tcp_addr, int tcp_port,
                 void *remote_buffer_info);
    uint64_t (*put)(void *obj, uintptr_t local, const std::string &host_id, uintptr_t remote, size_t length);
    uint64_t (*get)(void *obj, uintptr_t local, const std::string &host_id, uintptr_t remote, size_t length);
    uint64_t (*many)(void *obj, int kind, uintptr_t local, const std::vector<std::string> &host_ids,
                     const std::vector<uintptr_t> &remotes, size_t size);  // kind: 0 scatter, 1 gather, 2 broadcast
    bool (*is_complete)(void *obj, uint64_t handle);
    void (*result)(void *obj, uint64_t handle, void *transfer_result);
    int (*wait)(void *obj, uint64_t handle, int timeout_ms);
    int (*release)(void *obj, uint64_t handle);
    int (*last_code)();
    std::string (*last_message)();
};

}  // extern "C"

#endif
