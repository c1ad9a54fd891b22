// libmpcomm.so: the MPComm provider API (mpcomm.h) over mpcomm's Python core.
//
// Each mpcomm::MPComm owns one mpcomm.tent._bridge.Bridge (which owns one
// mpcomm Engine). Calls that change state or issue transfers take the GIL and
// call the bridge; completions come back through _mpcomm_native.complete(),
// which fills a C++ slot, so polling and waiting never touch Python.
//
// Invariants: the handle table's locks are never held while taking the GIL
// (the completion path takes them with the GIL held); no C++ exception and no
// Python exception leaves an entry point.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "mpcomm.h"

#ifndef MPCOMM_DEFAULT_PYTHON
#define MPCOMM_DEFAULT_PYTHON ""
#endif

namespace mpcomm {

// The interpreter to start when the host runs no Python, MPCOMM_PYTHON is unset and the library
// is not inside a site-packages: set by libmpcomm.so.1 (mpcomm_front.cpp), which found it and
// loaded its libpython before this library (mpcomm_impl_entry.cpp's set_python).
std::string defaultPython = MPCOMM_DEFAULT_PYTHON;

namespace {

thread_local int t_last_code = MPCOMM_SUCCESS;
thread_local std::string t_last_msg;

bool verbose() {
    static const bool v = [] {
        const char *lvl = std::getenv("MPCOMM_LOG_LEVEL");
        return lvl && (!std::strcmp(lvl, "debug") || !std::strcmp(lvl, "info"));
    }();
    return v;
}

int setLast(int code, std::string msg) {
    t_last_code = code;
    if (verbose() && code != MPCOMM_SUCCESS) {
        std::fprintf(stderr, "mpcomm: %d: %s\n", code, msg.c_str());
    }
    t_last_msg = std::move(msg);
    return code;
}

// ---- completion slots -------------------------------------------------------

struct Slot {
    std::mutex m;
    std::condition_variable cv;
    std::atomic<bool> done{false};
    int code = MPCOMM_ERR_IN_PROGRESS;
    size_t bytes = 0;
    const void *owner = nullptr;

    void finish(int c, size_t n) {
        {
            std::lock_guard<std::mutex> g(m);
            if (done.load(std::memory_order_relaxed)) return;  // first outcome wins
            code = c;
            bytes = n;
            done.store(true, std::memory_order_release);
        }
        cv.notify_all();
    }
};

class HandleTable {
   public:
    TransferHandle add(std::shared_ptr<Slot> slot) {
        TransferHandle h = next_.fetch_add(1, std::memory_order_relaxed);
        Shard &s = shard(h);
        std::lock_guard<std::mutex> g(s.m);
        s.map.emplace(h, std::move(slot));
        return h;
    }
    std::shared_ptr<Slot> find(TransferHandle h) {
        Shard &s = shard(h);
        std::lock_guard<std::mutex> g(s.m);
        auto it = s.map.find(h);
        return it == s.map.end() ? nullptr : it->second;
    }
    bool erase(TransferHandle h) {
        Shard &s = shard(h);
        std::lock_guard<std::mutex> g(s.m);
        return s.map.erase(h) != 0;
    }
    // Finishes every unfinished slot of one owner (after its shutdown).
    void finishAll(const void *owner, int code) {
        for (auto &s : shards_) {
            std::vector<std::shared_ptr<Slot>> todo;
            {
                std::lock_guard<std::mutex> g(s.m);
                for (auto &kv : s.map)
                    if (kv.second->owner == owner && !kv.second->done) todo.push_back(kv.second);
            }
            for (auto &slot : todo) slot->finish(code, 0);
        }
    }

   private:
    struct Shard {
        std::mutex m;
        std::unordered_map<TransferHandle, std::shared_ptr<Slot>> map;
    };
    Shard &shard(TransferHandle h) { return shards_[h % shards_.size()]; }
    std::array<Shard, 16> shards_;
    std::atomic<TransferHandle> next_{1};
};

HandleTable &table() {
    static HandleTable *t = new HandleTable();  // never destroyed: completions may arrive during exit
    return *t;
}

// ---- the embedded runtime -------------------------------------------------------

PyObject *nativeComplete(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "complete(handle, code, nbytes)");
        return nullptr;
    }
    unsigned long long h = PyLong_AsUnsignedLongLong(args[0]);
    long code = PyLong_AsLong(args[1]);
    unsigned long long n = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) return nullptr;
    if (auto slot = table().find(h)) slot->finish(static_cast<int>(code), n);
    Py_RETURN_NONE;
}

PyObject *nativeAttach(PyObject *, PyObject *);

PyMethodDef kNativeMethods[] = {
    {"complete", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(nativeComplete)),
     METH_FASTCALL, "complete(handle, code, nbytes): a transfer reached its terminal state"},
    {"attach", nativeAttach, METH_O,
     "attach(open_bridge): mpcomm.tent._bridge hands its entry point when it is imported"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kNativeModule = {PyModuleDef_HEAD_INIT, "_mpcomm_native",
                             "libmpcomm.so's completion entry point", -1, kNativeMethods};

// What a bridge hands back (mpcomm.tent._bridge.open_bridge): its entry points, in this order.
// No Python attribute is looked up by name here: the bridge module hands open_bridge to
// attach() when it is imported, and open_bridge returns the callables.
enum BridgeFn { FN_CALL, FN_ISSUE, FN_ISSUE_MANY, FN_TCP_PORT, FN_QUERY, FN_COUNT };

struct Runtime {
    int status = MPCOMM_ERR_RUNTIME;
    std::string error = "not started";
    PyObject *open_bridge = nullptr;  // mpcomm.tent._bridge.open_bridge, handed to attach()
    PyObject *complete = nullptr;
    PyObject *kind_write = nullptr;
    PyObject *kind_read = nullptr;
};

Runtime &runtime() {
    static Runtime *r = new Runtime();
    return *r;
}

PyObject *nativeAttach(PyObject *, PyObject *open_bridge) {
    if (!PyCallable_Check(open_bridge)) {
        PyErr_SetString(PyExc_TypeError, "attach(open_bridge): open_bridge must be callable");
        return nullptr;
    }
    Py_INCREF(open_bridge);
    Py_XSETREF(runtime().open_bridge, open_bridge);
    Py_RETURN_NONE;
}

std::string fetchPyError() {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    std::string msg = "unknown Python error";
    if (value || type) {
        PyObject *s = PyObject_Str(value ? value : type);
        const char *c = s ? PyUnicode_AsUTF8(s) : nullptr;
        if (c) msg = c;
        Py_XDECREF(s);
        if (type && PyType_Check(type)) msg = std::string(reinterpret_cast<PyTypeObject *>(type)->tp_name) + ": " + msg;
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear();
    return msg;
}

// A C++ thread keeps one Python thread state for its lifetime: creating and
// deleting one per call (what a bare PyGILState_Ensure/Release pair does on a
// thread Python does not know) costs more than the call itself.
struct ThreadAnchor {
    PyGILState_STATE outer;
    PyThreadState *saved = nullptr;
    ThreadAnchor() {
        outer = PyGILState_Ensure();
        saved = PyEval_SaveThread();
    }
    ~ThreadAnchor() {
        if (!Py_IsInitialized()) return;
        PyEval_RestoreThread(saved);
        PyGILState_Release(outer);
    }
};

struct Gil {
    PyGILState_STATE s;
    Gil() {
        if (!PyGILState_GetThisThreadState()) {
            static thread_local ThreadAnchor anchor;  // first call from this thread
        }
        s = PyGILState_Ensure();
    }
    ~Gil() { PyGILState_Release(s); }
};

// With the GIL held: the native module and the bridge class.
void importBridge(Runtime &rt) {
    PyObject *mod = PyModule_Create(&kNativeModule);
    if (!mod || PyDict_SetItemString(PyImport_GetModuleDict(), "_mpcomm_native", mod) != 0) {
        rt.error = "cannot create _mpcomm_native: " + fetchPyError();
        Py_XDECREF(mod);
        return;
    }
    rt.complete = PyCFunction_NewEx(&kNativeMethods[0], nullptr, mod);  // the function itself, not looked up
    Py_DECREF(mod);
    PyObject *bridge = PyImport_ImportModule("mpcomm.tent._bridge");  // its import calls attach()
    if (bridge && !rt.open_bridge) {  // imported before _mpcomm_native existed: run it again
        PyObject *again = PyImport_ReloadModule(bridge);
        Py_DECREF(bridge);
        bridge = again;
    }
    if (!bridge) {
        rt.error = "cannot import mpcomm.tent._bridge (is mpcomm installed for this Python? set MPCOMM_PYTHON): " +
                   fetchPyError();
        return;
    }
    Py_DECREF(bridge);
    if (!rt.open_bridge || !rt.complete) {
        rt.error = "mpcomm.tent._bridge did not attach its entry point: " + fetchPyError();
        return;
    }
    rt.kind_write = PyUnicode_InternFromString("write");
    rt.kind_read = PyUnicode_InternFromString("read");
    if (!rt.kind_write || !rt.kind_read) {
        rt.error = "cannot create the request kinds: " + fetchPyError();
        return;
    }
    rt.status = MPCOMM_SUCCESS;
    rt.error.clear();
}

// The interpreter of the environment this library is installed in:
// <prefix>/lib/pythonX.Y/site-packages/mpcomm/lib/libmpcomm.so.1 -> <prefix>/bin/python3.
// Empty when the library does not live in a site-packages (an editable install).
std::string pythonBesideLibrary() {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void *>(&setLast), &info) || !info.dli_fname) return "";
    std::string path = info.dli_fname;
    auto pos = path.rfind("/site-packages/mpcomm/lib/");
    if (pos == std::string::npos) return "";
    std::string libdir = path.substr(0, pos);  // <prefix>/lib/pythonX.Y
    auto l = libdir.rfind("/lib");
    if (l == std::string::npos) return "";
    std::string prefix = libdir.substr(0, l);
    for (const char *name : {"/bin/python3", "/bin/python"}) {
        std::string cand = prefix + name;
        if (access(cand.c_str(), X_OK) == 0) return cand;
    }
    return "";
}

void startRuntime() {
    Runtime &rt = runtime();
    // A host whose Python is another copy of libpython (a statically linked
    // interpreter) must not get a second interpreter from ours.
    using IsInit = int (*)();
    auto other = reinterpret_cast<IsInit>(dlsym(RTLD_DEFAULT, "Py_IsInitialized"));
    if (other && other != &Py_IsInitialized && other()) {
        rt.error = "the host process runs a Python that is not the libpython libmpcomm.so was built against";
        return;
    }
    if (Py_IsInitialized()) {  // inside a Python host: use its interpreter
        Gil g;
        importBridge(rt);
        return;
    }
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0;  // the host's signals stay the host's
    config.parse_argv = 0;
    // MPCOMM_PYTHON, else the environment the library is installed in, else
    // the one libmpcomm.so.1 located (an editable install: recorded relative to the library).
    std::string beside = pythonBesideLibrary();
    const char *py = std::getenv("MPCOMM_PYTHON");
    if (!py || !*py) py = beside.empty() ? defaultPython.c_str() : beside.c_str();
    if (py && *py && access(py, X_OK) != 0) {
        PyConfig_Clear(&config);
        rt.error = std::string("the interpreter to embed, ") + py +
                   ", does not exist (any more); set MPCOMM_PYTHON or rebuild with python -m mpcomm.tent.build";
        return;
    }
    PyStatus st = PyStatus_Ok();
    if (py && *py) st = PyConfig_SetBytesString(&config, &config.program_name, py);
    if (!PyStatus_Exception(st)) st = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(st)) {
        rt.error = std::string("cannot start Python (") + (py ? py : "") + "): " + (st.err_msg ? st.err_msg : "?");
        return;
    }
    importBridge(rt);
    // The initialising thread holds the GIL; give it up so any thread can call.
    PyEval_SaveThread();
}

int ensureRuntime() {
    static std::once_flag once;
    std::call_once(once, [] {
        try {
            startRuntime();
        } catch (...) {
            runtime().error = "unexpected C++ exception while starting Python";
        }
        if (runtime().status != MPCOMM_SUCCESS) std::fprintf(stderr, "mpcomm: %s\n", runtime().error.c_str());
    });
    Runtime &rt = runtime();
    if (rt.status != MPCOMM_SUCCESS) return setLast(MPCOMM_ERR_RUNTIME, rt.error);
    return MPCOMM_SUCCESS;
}

// A bridge result: 0, or (code, message). Consumes r. With the GIL held.
int resultCode(PyObject *r) {
    if (!r) return setLast(MPCOMM_ERR_RUNTIME, fetchPyError());
    int code = MPCOMM_ERR_RUNTIME;
    std::string msg = "bridge returned an unexpected value";
    if (PyLong_Check(r)) {
        code = static_cast<int>(PyLong_AsLong(r));
        msg.clear();
    } else if (PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2 && PyLong_Check(PyTuple_GET_ITEM(r, 0))) {
        code = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(r, 0)));
        const char *m = PyUnicode_Check(PyTuple_GET_ITEM(r, 1)) ? PyUnicode_AsUTF8(PyTuple_GET_ITEM(r, 1)) : nullptr;
        msg = m ? m : "";
    }
    Py_DECREF(r);
    if (PyErr_Occurred()) return setLast(MPCOMM_ERR_RUNTIME, fetchPyError());
    if (code > 0) code = MPCOMM_ERR_GENERIC;
    return code == MPCOMM_SUCCESS ? MPCOMM_SUCCESS : setLast(code, msg);
}

PyObject *pyStr(const std::string &s) { return PyUnicode_DecodeUTF8(s.data(), (Py_ssize_t)s.size(), "strict"); }

}  // namespace

// ---- MPComm ---------------------------------------------------------------------

struct MPComm::Impl {
    PyObject *bridge = nullptr;  // owned: the bridge's entry points (a tuple, BridgeFn order); GIL only
    std::mutex life;             // serialises init/shutdown

    ~Impl() {
        if (bridge && Py_IsInitialized()) {
            Gil g;
            Py_CLEAR(bridge);
        }
    }

    // Calls bridge.call(name, *args) with args built by the caller (stolen).
    int call(const char *name, PyObject *args) {
        if (!args) return setLast(MPCOMM_ERR_RUNTIME, fetchPyError());
        PyObject *fn = PyTuple_GET_ITEM(bridge, FN_CALL);
        Py_INCREF(fn);
        PyObject *full = PyTuple_New(PyTuple_GET_SIZE(args) + 1);
        PyObject *pyname = full ? PyUnicode_FromString(name) : nullptr;
        if (!pyname) {  // out of memory: nothing may be set into a tuple that is not there
            Py_XDECREF(full);
            Py_DECREF(fn);
            Py_DECREF(args);
            return setLast(MPCOMM_ERR_RUNTIME, fetchPyError());
        }
        PyTuple_SET_ITEM(full, 0, pyname);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) {
            PyObject *a = PyTuple_GET_ITEM(args, i);
            Py_INCREF(a);
            PyTuple_SET_ITEM(full, i + 1, a);
        }
        Py_DECREF(args);
        PyObject *r = PyObject_Call(fn, full, nullptr);
        Py_DECREF(fn);
        Py_DECREF(full);
        return resultCode(r);
    }

    template <typename Build>
    int simple(const char *name, Build build) {
        try {
            if (int rc = ensureRuntime()) return rc;
            Gil g;
            if (!bridge) return setLast(MPCOMM_ERR_NOT_INITIALIZED, "init() was not called");
            return call(name, build());
        } catch (...) {
            return setLast(MPCOMM_ERR_GENERIC, "unexpected C++ exception");
        }
    }

    // Issues through bridge.<method>(handle, ...) and returns the handle or 0.
    template <typename Call>
    TransferHandle issue(Call call_bridge) {
        try {
            if (ensureRuntime()) return INVALID_TRANSFER_HANDLE;
            auto slot = std::make_shared<Slot>();
            slot->owner = this;
            // In the table before Python runs: a transfer may finish inline.
            TransferHandle h = table().add(slot);
            int rc;
            {
                Gil g;
                rc = bridge ? resultCode(call_bridge(h))
                            : setLast(MPCOMM_ERR_NOT_INITIALIZED, "init() was not called");
            }
            if (rc != MPCOMM_SUCCESS) {
                table().erase(h);
                return INVALID_TRANSFER_HANDLE;
            }
            return h;
        } catch (...) {
            setLast(MPCOMM_ERR_GENERIC, "unexpected C++ exception");
            return INVALID_TRANSFER_HANDLE;
        }
    }

    TransferHandle one(PyObject *kind, uintptr_t local, const std::string &host, uintptr_t remote, size_t len) {
        return issue([&](TransferHandle h) -> PyObject * {
            PyObject *args[7];
            args[0] = nullptr;  // PY_VECTORCALL_ARGUMENTS_OFFSET: the callee may use this slot
            args[1] = PyLong_FromUnsignedLongLong(h);
            args[2] = kind;
            args[3] = PyLong_FromUnsignedLongLong(local);
            args[4] = pyStr(host);
            args[5] = PyLong_FromUnsignedLongLong(remote);
            args[6] = PyLong_FromSize_t(len);
            PyObject *r = nullptr;
            if (args[1] && args[3] && args[4] && args[5] && args[6])
                r = PyObject_Vectorcall(PyTuple_GET_ITEM(bridge, FN_ISSUE), args + 1,
                                        6 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
            for (int i : {1, 3, 4, 5, 6}) Py_XDECREF(args[i]);
            return r;
        });
    }

    TransferHandle many(const char *mode, uintptr_t local, const std::vector<std::string> &hosts,
                        const std::vector<uintptr_t> &remotes, size_t len) {
        if (hosts.empty() || hosts.size() != remotes.size()) {
            setLast(MPCOMM_ERR_INVALID_ARGUMENT, "host_ids and remote_addrs must be non-empty and of equal size");
            return INVALID_TRANSFER_HANDLE;
        }
        return issue([&](TransferHandle h) -> PyObject * {
            PyObject *hl = PyList_New((Py_ssize_t)hosts.size());
            PyObject *rl = PyList_New((Py_ssize_t)remotes.size());
            for (size_t i = 0; hl && rl && i < hosts.size(); ++i) {
                PyList_SET_ITEM(hl, (Py_ssize_t)i, pyStr(hosts[i]));
                PyList_SET_ITEM(rl, (Py_ssize_t)i, PyLong_FromUnsignedLongLong(remotes[i]));
            }
            PyObject *r = nullptr;
            if (hl && rl && !PyErr_Occurred())
                r = PyObject_CallFunction(PyTuple_GET_ITEM(bridge, FN_ISSUE_MANY), "KsKOOn", (unsigned long long)h,
                                          mode, (unsigned long long)local, hl, rl, (Py_ssize_t)len);
            Py_XDECREF(hl);
            Py_XDECREF(rl);
            return r;
        });
    }
};

MPComm::MPComm() : impl_(new Impl()) {}

MPComm::~MPComm() {
    try {
        shutdown();
    } catch (...) {
    }
}

int MPComm::init(const std::string &host_id, const std::string &device_names, int tcp_port) {
    try {
        if (int rc = ensureRuntime()) return rc;
        std::lock_guard<std::mutex> l(impl_->life);
        Gil g;
        if (!impl_->bridge) {
            PyObject *fns = PyObject_CallOneArg(runtime().open_bridge, runtime().complete);
            if (!fns) return setLast(MPCOMM_ERR_RUNTIME, fetchPyError());
            if (!PyTuple_CheckExact(fns) || PyTuple_GET_SIZE(fns) != FN_COUNT) {
                Py_DECREF(fns);
                return setLast(MPCOMM_ERR_RUNTIME, "mpcomm.tent._bridge.open_bridge returned an unexpected value");
            }
            impl_->bridge = fns;
        }
        return impl_->call("init", Py_BuildValue("(NNi)", pyStr(host_id), pyStr(device_names), tcp_port));
    } catch (...) {
        return setLast(MPCOMM_ERR_GENERIC, "unexpected C++ exception");
    }
}

int MPComm::getTcpPort() const {
    try {
        if (ensureRuntime()) return 0;
        Gil g;
        if (!impl_->bridge) return 0;
        PyObject *r = PyObject_CallNoArgs(PyTuple_GET_ITEM(impl_->bridge, FN_TCP_PORT));
        if (!r) {
            setLast(MPCOMM_ERR_RUNTIME, fetchPyError());
            return 0;
        }
        long port = PyLong_AsLong(r);
        Py_DECREF(r);
        if (PyErr_Occurred()) {
            setLast(MPCOMM_ERR_RUNTIME, fetchPyError());
            return 0;
        }
        return static_cast<int>(port);
    } catch (...) {
        return 0;
    }
}

int MPComm::startAcceptThread() {
    return impl_->simple("start_accept", [] { return PyTuple_New(0); });
}

int MPComm::stopAcceptThread() {
    return impl_->simple("stop_accept", [] { return PyTuple_New(0); });
}

int MPComm::shutdown() {
    try {
        if (!impl_ || !Py_IsInitialized()) return MPCOMM_SUCCESS;
        std::lock_guard<std::mutex> l(impl_->life);
        int rc = MPCOMM_SUCCESS;
        {
            Gil g;
            if (!impl_->bridge) return MPCOMM_SUCCESS;
            rc = impl_->call("shutdown", PyTuple_New(0));
            Py_CLEAR(impl_->bridge);
        }
        // Whatever the engine did not get to report before closing.
        table().finishAll(impl_.get(), MPCOMM_ERR_SHUTDOWN);
        return rc;
    } catch (...) {
        return setLast(MPCOMM_ERR_GENERIC, "unexpected C++ exception");
    }
}

int MPComm::registerMemory(void *addr, size_t length) {
    return impl_->simple("register_memory", [&] { return Py_BuildValue("(Kn)", (unsigned long long)(uintptr_t)addr, (Py_ssize_t)length); });
}

int MPComm::unregisterMemory(void *addr) {
    return impl_->simple("unregister_memory", [&] { return Py_BuildValue("(K)", (unsigned long long)(uintptr_t)addr); });
}

int MPComm::publishBuffer(void *addr, size_t length, int numa_node) {
    return impl_->simple("publish", [&] {
        return Py_BuildValue("(Kni)", (unsigned long long)(uintptr_t)addr, (Py_ssize_t)length, numa_node);
    });
}

int MPComm::unpublishBuffer(void *addr) {
    return impl_->simple("unpublish", [&] { return Py_BuildValue("(K)", (unsigned long long)(uintptr_t)addr); });
}

int MPComm::connect(const std::string &host_id, const std::string &tcp_addr, int tcp_port) {
    return impl_->simple("connect", [&] { return Py_BuildValue("(NNi)", pyStr(host_id), pyStr(tcp_addr), tcp_port); });
}

int MPComm::queryRemoteBuffer(const std::string &host_id, const std::string &tcp_addr, int tcp_port,
                              RemoteBufferInfo &info) {
    try {
        if (int rc = ensureRuntime()) return rc;
        std::vector<RemoteBufferEntry> bufs;
        {
            Gil g;
            if (!impl_->bridge) return setLast(MPCOMM_ERR_NOT_INITIALIZED, "init() was not called");
            PyObject *r = PyObject_CallFunction(PyTuple_GET_ITEM(impl_->bridge, FN_QUERY), "NNi", pyStr(host_id),
                                                pyStr(tcp_addr), tcp_port);
            if (!r) return setLast(MPCOMM_ERR_RUNTIME, fetchPyError());
            if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
                Py_DECREF(r);
                return setLast(MPCOMM_ERR_RUNTIME, "bridge.query returned an unexpected value");
            }
            int code = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(r, 0)));
            PyObject *list = PyTuple_GET_ITEM(r, 1);
            if (code != MPCOMM_SUCCESS || !PyList_Check(list)) {
                const char *m = PyUnicode_Check(list) ? PyUnicode_AsUTF8(list) : nullptr;
                std::string msg = m ? m : "bridge.query failed";
                Py_DECREF(r);
                PyErr_Clear();
                return setLast(code == MPCOMM_SUCCESS || code > 0 ? MPCOMM_ERR_RUNTIME : code, msg);
            }
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) {
                RemoteBufferEntry e;
                PyObject *t = PyList_GET_ITEM(list, i);
                if (!PyArg_ParseTuple(t, "KKi", &e.addr, &e.length, &e.numa_node)) {
                    Py_DECREF(r);
                    return setLast(MPCOMM_ERR_RUNTIME, fetchPyError());
                }
                bufs.push_back(std::move(e));
            }
            Py_DECREF(r);
        }
        info.host_id = host_id;
        info.buffers = std::move(bufs);
        return MPCOMM_SUCCESS;
    } catch (...) {
        return setLast(MPCOMM_ERR_GENERIC, "unexpected C++ exception");
    }
}

TransferHandle MPComm::putAsync(uintptr_t local_addr, const std::string &host_id, uintptr_t remote_addr,
                                size_t length) {
    if (ensureRuntime()) return INVALID_TRANSFER_HANDLE;
    return impl_->one(runtime().kind_write, local_addr, host_id, remote_addr, length);
}

TransferHandle MPComm::getAsync(uintptr_t local_addr, const std::string &host_id, uintptr_t remote_addr,
                                size_t length) {
    if (ensureRuntime()) return INVALID_TRANSFER_HANDLE;
    return impl_->one(runtime().kind_read, local_addr, host_id, remote_addr, length);
}

TransferHandle MPComm::scatterAsync(uintptr_t local_addr, const std::vector<std::string> &host_ids,
                                    const std::vector<uintptr_t> &remote_addrs, size_t chunk) {
    return impl_->many("scatter", local_addr, host_ids, remote_addrs, chunk);
}

TransferHandle MPComm::gatherAsync(uintptr_t local_addr, const std::vector<std::string> &host_ids,
                                   const std::vector<uintptr_t> &remote_addrs, size_t chunk) {
    return impl_->many("gather", local_addr, host_ids, remote_addrs, chunk);
}

TransferHandle MPComm::broadcastAsync(uintptr_t local_addr, const std::vector<std::string> &host_ids,
                                      const std::vector<uintptr_t> &remote_addrs, size_t length) {
    return impl_->many("broadcast", local_addr, host_ids, remote_addrs, length);
}

bool MPComm::isTransferComplete(TransferHandle handle) {
    try {
        auto slot = table().find(handle);
        return !slot || slot->done.load(std::memory_order_acquire);
    } catch (...) {
        return true;
    }
}

TransferResult MPComm::getTransferResult(TransferHandle handle) {
    TransferResult out;
    try {
        auto slot = table().find(handle);
        if (!slot) {
            out.error_code = MPCOMM_ERR_INVALID_HANDLE;
            return out;
        }
        std::lock_guard<std::mutex> g(slot->m);
        if (!slot->done.load(std::memory_order_relaxed)) {
            out.error_code = MPCOMM_ERR_IN_PROGRESS;
            return out;
        }
        out.error_code = slot->code;
        out.bytes_transferred = slot->bytes;
    } catch (...) {
        out.error_code = MPCOMM_ERR_GENERIC;
    }
    return out;
}

int MPComm::waitTransfer(TransferHandle handle, int timeout_ms) {
    try {
        auto slot = table().find(handle);
        if (!slot) return setLast(MPCOMM_ERR_INVALID_HANDLE, "unknown or released handle");
        // A caller holding the GIL would block the completion it waits for.
        PyThreadState *saved = nullptr;
        if (Py_IsInitialized() && PyGILState_Check()) saved = PyEval_SaveThread();
        int code;
        {
            std::unique_lock<std::mutex> l(slot->m);
            auto ready = [&] { return slot->done.load(std::memory_order_relaxed); };
            bool ok = true;
            if (timeout_ms < 0)
                slot->cv.wait(l, ready);
            else
                ok = slot->cv.wait_for(l, std::chrono::milliseconds(timeout_ms), ready);
            code = ok ? slot->code : MPCOMM_ERR_TIMEOUT;
        }
        if (saved) PyEval_RestoreThread(saved);
        return code;
    } catch (...) {
        return setLast(MPCOMM_ERR_GENERIC, "unexpected C++ exception");
    }
}

int MPComm::releaseTransfer(TransferHandle handle) {
    try {
        if (handle == INVALID_TRANSFER_HANDLE || !table().erase(handle))
            return setLast(MPCOMM_ERR_INVALID_HANDLE, "unknown or already released handle");
        return MPCOMM_SUCCESS;
    } catch (...) {
        return MPCOMM_ERR_GENERIC;
    }
}

int MPComm::lastErrorCode() { return t_last_code; }

std::string MPComm::lastErrorMessage() { return t_last_msg; }

const char *version() { return "1.4.0"; }

}  // namespace mpcomm
