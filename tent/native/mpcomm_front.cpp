// libmpcomm.so.1: the MPComm provider API (mpcomm.h) without a link to any libpython.
//
// A C++ host links this library only. At the first init() it makes sure a
// Python runtime is in the process, then loads the implementation
// (libmpcomm_python<X.Y>.so beside it: mpcomm.cpp, which calls the Python C
// API) and forwards every call through its table (mpcomm_abi.h):
//
// 1. A host that already runs Python (Py_IsInitialized is in the process):
//    nothing to load; the implementation binds to that interpreter.
// 2. Else the interpreter to embed: MPCOMM_PYTHON, else `python` of the [tent]
//    table in the MPCOMM_CONFIG file, else the environment this
//    library is installed in (<prefix>/lib/pythonX.Y/site-packages/mpcomm/lib
//    -> <prefix>/bin/python3), else the one recorded at build time relative to
//    this library (an editable install's build/native/lib). That interpreter is
//    asked (sysconfig) for its LIBDIR and LDLIBRARY and must be Python X.Y (the
//    version the implementation was compiled for) with a shared libpython,
//    which is loaded with RTLD_GLOBAL so that the implementation resolves
//    against it.
//
// Any failure is an error code (MPCOMM_ERR_RUNTIME) and a message from
// lastErrorMessage(), for init() and every later call; never a crash.
#include <dlfcn.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>

#include "mpcomm.h"
#include "mpcomm_abi.h"

#ifndef MPCOMM_PY_VERSION
#error "tent/build.py defines MPCOMM_PY_VERSION (the X.Y of the implementation library)"
#endif
#ifndef MPCOMM_PYTHON_REL
#define MPCOMM_PYTHON_REL ""  // the interpreter relative to this library's directory; "" in a wheel
#endif

extern char **environ;

struct mpcomm::MPComm::Impl {
    void *obj = nullptr;  // the implementation's MPComm, once init() loaded it
};

namespace mpcomm {
namespace {

thread_local int t_code = MPCOMM_SUCCESS;  // this library's own last error (the runtime did not load)
thread_local std::string t_msg;
thread_local bool t_own = false;  // true: lastError*() answer t_code/t_msg, not the implementation's

int fail(int code, std::string msg) {
    t_code = code;
    t_msg = std::move(msg);
    t_own = true;
    const char *lvl = std::getenv("MPCOMM_LOG_LEVEL");
    if (lvl && (!std::strcmp(lvl, "debug") || !std::strcmp(lvl, "info")))
        std::fprintf(stderr, "mpcomm: %d: %s\n", code, t_msg.c_str());
    return code;
}

std::string ownDirectory() {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void *>(&fail), &info) || !info.dli_fname) return "";
    std::string path = info.dli_fname;
    auto slash = path.rfind('/');
    return slash == std::string::npos ? "." : path.substr(0, slash);
}

bool executable(const std::string &p) { return !p.empty() && access(p.c_str(), X_OK) == 0; }

// `python = "..."` of the [tent] table in the TOML file MPCOMM_CONFIG names, or "". A line scan,
// not a TOML parser (no Python runs yet): a basic or literal string on the key's own line.
std::string configPython(std::string &file) {
    const char *path = std::getenv("MPCOMM_CONFIG");
    if (!path || !*path) return "";
    file = path;
    FILE *f = std::fopen(path, "r");
    if (!f) return "";
    std::string found;
    bool inTent = false;
    char buf[4096];
    auto trim = [](std::string v) {
        size_t a = v.find_first_not_of(" \t\r\n"), b = v.find_last_not_of(" \t\r\n");
        return a == std::string::npos ? std::string() : v.substr(a, b - a + 1);
    };
    while (std::fgets(buf, sizeof buf, f)) {
        std::string line = trim(buf);
        if (line.empty() || line[0] == '#') continue;
        if (line[0] == '[') {
            inTent = line == "[tent]";
            continue;
        }
        if (!inTent || line.compare(0, 6, "python") != 0) continue;
        std::string rest = trim(line.substr(6));
        if (rest.empty() || rest[0] != '=') continue;
        rest = trim(rest.substr(1));
        if (rest.size() >= 2 && (rest[0] == '"' || rest[0] == '\'')) {
            size_t end = rest.find(rest[0], 1);
            if (end != std::string::npos) found = rest.substr(1, end - 1);
        }
    }
    std::fclose(f);
    return found;
}

// The interpreter to embed, and where that choice came from (for messages).
std::string chooseInterpreter(std::string &from) {
    const char *env = std::getenv("MPCOMM_PYTHON");
    if (env && *env) {
        from = "MPCOMM_PYTHON";
        return env;
    }
    std::string file;
    std::string configured = configPython(file);
    if (!configured.empty()) {
        from = "tent.python in " + file;
        return configured;
    }
    std::string dir = ownDirectory();
    auto pos = dir.rfind("/site-packages/mpcomm/lib");
    if (pos != std::string::npos) {
        std::string libdir = dir.substr(0, pos);  // <prefix>/lib/pythonX.Y
        auto l = libdir.rfind("/lib");
        if (l != std::string::npos) {
            from = "the environment libmpcomm.so.1 is installed in";
            for (const char *name : {"/bin/python3", "/bin/python"}) {
                std::string cand = libdir.substr(0, l) + name;
                if (executable(cand)) return cand;
            }
            return libdir.substr(0, l) + "/bin/python3";
        }
    }
    from = "the location recorded at build time (relative to " + dir + ")";
    if (!*MPCOMM_PYTHON_REL) return "";
    return dir + "/" + MPCOMM_PYTHON_REL;
}

// Runs `python -c ...` (no shell) and returns its stdout; "" with why on failure.
std::string ask(const std::string &python, std::string &why) {
    static const char *kCode =
        "import sys, sysconfig as s\n"
        "print('%d.%d' % sys.version_info[:2])\n"
        "print(s.get_config_var('LIBDIR') or '')\n"
        "print(s.get_config_var('LDLIBRARY') or '')\n"
        "print(s.get_config_var('Py_ENABLE_SHARED') or 0)\n";
    int fds[2];
    if (pipe(fds) != 0) {
        why = "pipe() failed";
        return "";
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    posix_spawn_file_actions_addclose(&fa, fds[1]);
    const char *argv[] = {python.c_str(), "-I", "-c", kCode, nullptr};
    pid_t pid = -1;
    int rc = posix_spawn(&pid, python.c_str(), &fa, nullptr, const_cast<char *const *>(argv), environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    std::string out;
    if (rc == 0) {
        char buf[4096];
        ssize_t n;
        while ((n = read(fds[0], buf, sizeof buf)) > 0 && out.size() < 65536) out.append(buf, static_cast<size_t>(n));
    }
    close(fds[0]);
    if (rc != 0) {
        why = std::string("cannot run it (") + std::strerror(rc) + ")";
        return "";
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        why = "it failed to report its sysconfig (is it a Python interpreter?)";
        return "";
    }
    return out;
}

// Loads the interpreter's libpython into the global scope; "" or why not.
std::string loadLibpython() {
    std::string from;
    std::string python = chooseInterpreter(from);
    if (python.empty())
        return "no Python interpreter to embed: set MPCOMM_PYTHON to the python of the environment mpcomm is "
               "installed in";
    if (!executable(python))
        return "the interpreter to embed, " + python + " (from " + from + "), does not exist or is not executable; " +
               "set MPCOMM_PYTHON";
    std::string why;
    std::string out = ask(python, why);
    if (out.empty() && why.empty()) why = "it printed nothing for its sysconfig (is it a Python interpreter?)";
    if (out.empty()) return "the interpreter to embed, " + python + " (from " + from + "): " + why;
    std::string lines[4];
    size_t at = 0;
    for (auto &line : lines) {
        size_t nl = out.find('\n', at);
        if (nl == std::string::npos) return python + " answered something unexpected: " + out.substr(0, 200);
        line = out.substr(at, nl - at);
        at = nl + 1;
    }
    if (lines[0] != MPCOMM_PY_VERSION)
        return python + " is Python " + lines[0] + ", but this libmpcomm.so.1 was built for Python " +
               MPCOMM_PY_VERSION + ": set MPCOMM_PYTHON to a " MPCOMM_PY_VERSION " interpreter";
    if (lines[3] != "1" || lines[2].find(".so") == std::string::npos)
        return python + " has no shared libpython (it was built without --enable-shared): a C++ host cannot " +
               "embed it; use an interpreter with libpython" + MPCOMM_PY_VERSION + ".so";
    std::string lib = lines[1] + "/" + lines[2];
    if (!dlopen(lib.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
        const char *e = dlerror();
        // LIBDIR may be the build machine's; the soname on the loader's path is the same library.
        if (!dlopen(lines[2].c_str(), RTLD_NOW | RTLD_GLOBAL))
            return "cannot load " + lib + " (the libpython of " + python + "): " + (e ? e : "?");
    }
    return "";
}

struct Runtime {
    const MpcommImplTable *t = nullptr;
    std::string error = "init() was not called";
};

Runtime &runtime() {
    static Runtime rt;
    return rt;
}

// Once per process: libpython (unless the host has one) and the implementation.
const MpcommImplTable *ensureRuntime() {
    static std::once_flag once;
    std::call_once(once, [] {
        Runtime &rt = runtime();
        try {
            bool hosted = dlsym(RTLD_DEFAULT, "Py_IsInitialized") != nullptr;
            std::string python;
            if (!hosted) {
                std::string why = loadLibpython();
                if (!why.empty()) {
                    rt.error = why;
                    return;
                }
                std::string from;
                python = chooseInterpreter(from);
            }
            std::string impl = ownDirectory() + "/libmpcomm_python" MPCOMM_PY_VERSION ".so";
            void *h = dlopen(impl.c_str(), RTLD_NOW | RTLD_LOCAL);
            if (!h) {
                const char *e = dlerror();
                rt.error = "cannot load " + impl + ": " + (e ? e : "?");
                return;
            }
            using Get = const MpcommImplTable *(*)();
            auto get = reinterpret_cast<Get>(dlsym(h, MPCOMM_IMPL_TABLE_SYMBOL));
            const MpcommImplTable *t = get ? get() : nullptr;
            if (!t || t->abi != MPCOMM_IMPL_ABI) {
                rt.error = impl + " is not the implementation this libmpcomm.so.1 was built with";
                return;
            }
            if (!python.empty()) t->set_python(python.c_str());
            rt.t = t;
            rt.error.clear();
        } catch (...) {
            rt.error = "unexpected C++ exception while loading the Python runtime";
        }
        if (!rt.t) std::fprintf(stderr, "mpcomm: %s\n", rt.error.c_str());
    });
    return runtime().t;
}

// The implementation's object behind `impl`, or null (init() has not loaded it).
const MpcommImplTable *ready(const std::unique_ptr<MPComm::Impl> &impl) {
    const MpcommImplTable *t = runtime().t;
    if (t && impl && impl->obj) {
        t_own = false;
        return t;
    }
    return nullptr;
}

int notReady() {
    const std::string &e = runtime().error;
    return fail(runtime().t || e == "init() was not called" ? MPCOMM_ERR_NOT_INITIALIZED : MPCOMM_ERR_RUNTIME,
                runtime().t ? "init() was not called" : e);
}

}  // namespace

MPComm::MPComm() : impl_(new (std::nothrow) Impl()) {}

MPComm::~MPComm() {
    try {
        if (const MpcommImplTable *t = ready(impl_)) t->destroy(impl_->obj);  // shuts down if still running
    } catch (...) {
    }
}

int MPComm::init(const std::string &host_id, const std::string &device_names, int tcp_port) {
    try {
        if (!impl_) return fail(MPCOMM_ERR_GENERIC, "out of memory");
        const MpcommImplTable *t = ensureRuntime();
        if (!t) return fail(MPCOMM_ERR_RUNTIME, runtime().error);
        if (!impl_->obj) impl_->obj = t->create();
        if (!impl_->obj) return fail(MPCOMM_ERR_GENERIC, "out of memory");
        t_own = false;
        return t->init(impl_->obj, host_id, device_names, tcp_port);
    } catch (...) {
        return fail(MPCOMM_ERR_GENERIC, "unexpected C++ exception");
    }
}

int MPComm::getTcpPort() const {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->get_tcp_port(impl_->obj) : 0;
}

int MPComm::startAcceptThread() {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->start_accept(impl_->obj) : notReady();
}

int MPComm::stopAcceptThread() {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->stop_accept(impl_->obj) : notReady();
}

int MPComm::shutdown() {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->shutdown(impl_->obj) : MPCOMM_SUCCESS;
}

int MPComm::registerMemory(void *addr, size_t length) {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->register_memory(impl_->obj, addr, length) : notReady();
}

int MPComm::unregisterMemory(void *addr) {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->unregister_memory(impl_->obj, addr) : notReady();
}

int MPComm::publishBuffer(void *addr, size_t length, int numa_node) {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->publish(impl_->obj, addr, length, numa_node) : notReady();
}

int MPComm::unpublishBuffer(void *addr) {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->unpublish(impl_->obj, addr) : notReady();
}

int MPComm::connect(const std::string &host_id, const std::string &tcp_addr, int tcp_port) {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->connect(impl_->obj, host_id, tcp_addr, tcp_port) : notReady();
}

int MPComm::queryRemoteBuffer(const std::string &host_id, const std::string &tcp_addr, int tcp_port,
                              RemoteBufferInfo &info) {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->query(impl_->obj, host_id, tcp_addr, tcp_port, &info) : notReady();
}

TransferHandle MPComm::putAsync(uintptr_t local_addr, const std::string &host_id, uintptr_t remote_addr,
                                size_t length) {
    const MpcommImplTable *t = ready(impl_);
    if (!t) return notReady(), INVALID_TRANSFER_HANDLE;
    return t->put(impl_->obj, local_addr, host_id, remote_addr, length);
}

TransferHandle MPComm::getAsync(uintptr_t local_addr, const std::string &host_id, uintptr_t remote_addr,
                                size_t length) {
    const MpcommImplTable *t = ready(impl_);
    if (!t) return notReady(), INVALID_TRANSFER_HANDLE;
    return t->get(impl_->obj, local_addr, host_id, remote_addr, length);
}

TransferHandle MPComm::scatterAsync(uintptr_t local_addr, const std::vector<std::string> &host_ids,
                                    const std::vector<uintptr_t> &remote_addrs, size_t chunk) {
    const MpcommImplTable *t = ready(impl_);
    if (!t) return notReady(), INVALID_TRANSFER_HANDLE;
    return t->many(impl_->obj, 0, local_addr, host_ids, remote_addrs, chunk);
}

TransferHandle MPComm::gatherAsync(uintptr_t local_addr, const std::vector<std::string> &host_ids,
                                   const std::vector<uintptr_t> &remote_addrs, size_t chunk) {
    const MpcommImplTable *t = ready(impl_);
    if (!t) return notReady(), INVALID_TRANSFER_HANDLE;
    return t->many(impl_->obj, 1, local_addr, host_ids, remote_addrs, chunk);
}

TransferHandle MPComm::broadcastAsync(uintptr_t local_addr, const std::vector<std::string> &host_ids,
                                      const std::vector<uintptr_t> &remote_addrs, size_t length) {
    const MpcommImplTable *t = ready(impl_);
    if (!t) return notReady(), INVALID_TRANSFER_HANDLE;
    return t->many(impl_->obj, 2, local_addr, host_ids, remote_addrs, length);
}

bool MPComm::isTransferComplete(TransferHandle handle) {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->is_complete(impl_->obj, handle) : true;  // as for an unknown handle
}

TransferResult MPComm::getTransferResult(TransferHandle handle) {
    TransferResult out;
    const MpcommImplTable *t = ready(impl_);
    if (t) t->result(impl_->obj, handle, &out);
    return out;  // without the runtime: MPCOMM_ERR_INVALID_HANDLE, as for an unknown handle
}

int MPComm::waitTransfer(TransferHandle handle, int timeout_ms) {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->wait(impl_->obj, handle, timeout_ms)
             : fail(MPCOMM_ERR_INVALID_HANDLE, "unknown or released handle");
}

int MPComm::releaseTransfer(TransferHandle handle) {
    const MpcommImplTable *t = ready(impl_);
    return t ? t->release(impl_->obj, handle) : fail(MPCOMM_ERR_INVALID_HANDLE, "unknown or already released handle");
}

int MPComm::lastErrorCode() {
    const MpcommImplTable *t = runtime().t;
    return t_own || !t ? t_code : t->last_code();
}

std::string MPComm::lastErrorMessage() {
    const MpcommImplTable *t = runtime().t;
    return t_own || !t ? t_msg : t->last_message();
}

const char *version() { return "1.4.0"; }

}  // namespace mpcomm
