/* A cache in front of CPython's arena allocator, for the test processes (tests/helpers/arena_cache.py).
 *
 * CPython 3.11 and 3.12 take each 16 KiB chunk of a thread's frame stack, and each 1 MiB arena of
 * its small-object allocator, from the arena allocator: mmap, and munmap as soon as it is empty
 * again. A loop that calls across a chunk's boundary maps and unmaps one on every call
 * (python/cpython#142183; 3.13.x and 3.14 keep one chunk). Triton's interpreter does so: a third of
 * the GPU path's interpreter tests went to the kernel, mapping and faulting in fresh pages.
 *
 * This allocator keeps up to KEEP freed blocks of each of the two sizes and hands them out again;
 * every block still comes from, and any block it does not keep goes back to, the allocator it
 * replaced, so blocks mapped before it was installed are freed correctly. CPython calls the arena
 * allocator with the GIL held: no lock. */
#include <stddef.h>

typedef struct {
    void *ctx;
    void *(*alloc)(void *ctx, size_t size);
    void (*free)(void *ctx, void *ptr, size_t size);
} ArenaAllocator; /* CPython's PyObjectArenaAllocator */

extern void PyObject_GetArenaAllocator(ArenaAllocator *allocator);
extern void PyObject_SetArenaAllocator(ArenaAllocator *allocator);

#define KEEP 8

static ArenaAllocator prior;
static size_t sizes[2];
static void *kept[2][KEEP];
static int num_kept[2];

static int kind(size_t size) { return size == sizes[0] ? 0 : size == sizes[1] ? 1 : -1; }

static void *cached_alloc(void *ctx, size_t size) {
    (void)ctx;
    int k = kind(size);
    if (k >= 0 && num_kept[k] > 0)
        return kept[k][--num_kept[k]];
    return prior.alloc(prior.ctx, size);
}

static void cached_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    int k = kind(size);
    if (k >= 0 && num_kept[k] < KEEP) {
        kept[k][num_kept[k]++] = ptr;
        return;
    }
    prior.free(prior.ctx, ptr, size);
}

/* Put the cache in front of the current arena allocator, for blocks of `chunk` and `arena` bytes;
 * 1 when installed, 0 when it was already. */
int install(size_t chunk, size_t arena) {
    ArenaAllocator mine = {NULL, cached_alloc, cached_free};
    PyObject_GetArenaAllocator(&prior);
    if (prior.alloc == cached_alloc)
        return 0;
    sizes[0] = chunk;
    sizes[1] = arena;
    PyObject_SetArenaAllocator(&mine);
    return 1;
}
