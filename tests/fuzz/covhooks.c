/* Preloaded before gcc's libasan in the sanitized fuzz runs (tests/core/test_native_sanitized.py).
 *
 * libasan defines weak no-op versions of the coverage hooks that atheris' libFuzzer implements
 * (__sanitizer_cov_8bit_counters_init and the rest). With libasan preloaded, its no-ops come first
 * in the dynamic linker's search order, so atheris' coverage counters never reach libFuzzer: every
 * input looks uninteresting and the seed corpus is thrown away. These definitions come first
 * instead and hand each call to libFuzzer inside the atheris core named by MPCOMM_ATHERIS_CORE. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

static void *fuzzer(const char *name) {
    static void *core;
    if (!core) {
        const char *path = getenv("MPCOMM_ATHERIS_CORE");
        core = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
    }
    return core ? dlsym(core, name) : NULL;
}

#define FORWARD(name, params, args)                        \
    void name params {                                     \
        static void (*f) params;                           \
        if (!f)                                            \
            f = (void (*) params)fuzzer(#name);            \
        if (f)                                             \
            f args;                                        \
    }

FORWARD(__sanitizer_cov_8bit_counters_init, (uint8_t *a, uint8_t *b), (a, b))
FORWARD(__sanitizer_cov_pcs_init, (const uintptr_t *a, const uintptr_t *b), (a, b))
FORWARD(__sanitizer_cov_trace_cmp8, (uint64_t a, uint64_t b), (a, b))
FORWARD(__sanitizer_cov_trace_const_cmp8, (uint64_t a, uint64_t b), (a, b))
