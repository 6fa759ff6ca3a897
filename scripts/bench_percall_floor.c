/* The copy floor of scripts/bench_percall.py's 61-layer 1-row backups: the same rows (row 5 of
 * every layer's K and V, or of every MLA layer) copied by plain memcpy into one page_first host
 * slot, cache-hot, with no planning, checks or Python; best of 7 x 2000 calls. What the pool's
 * call costs above this is its own overhead; the per-call target cannot go below it.
 *
 *   cc -O2 -o /tmp/percall_floor scripts/bench_percall_floor.c && /tmp/percall_floor
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

/* 61 layers, `planes` planes of `row` bytes per token, 1024 device tokens, page of 64. */
static double floor_us(size_t row, int planes) {
    enum { LAYERS = 61, TOKENS = 1024, PAGE = 64 };
    char **dev = malloc(sizeof(char *) * LAYERS * planes);
    for (int i = 0; i < LAYERS * planes; i++) {
        dev[i] = aligned_alloc(64, TOKENS * row);
        memset(dev[i], i, TOKENS * row);
    }
    size_t page_bytes = (size_t)PAGE * planes * LAYERS * row;
    char *host = aligned_alloc(64, page_bytes);
    memset(host, 0, page_bytes);
    double best = 1e30;
    for (int r = 0; r < 7; r++) {
        double t0 = now_ns();
        for (int it = 0; it < 2000; it++) {
            for (int k = 0; k < planes; k++)
                for (int l = 0; l < LAYERS; l++)
                    memcpy(host + ((size_t)k * LAYERS + l) * PAGE * row, dev[k * LAYERS + l] + 5 * row, row);
            __asm__ volatile("" ::: "memory"); /* keep every call's copies */
        }
        double t = (now_ns() - t0) / 2000;
        if (t < best) best = t;
    }
    for (int i = 0; i < LAYERS * planes; i++) free(dev[i]);
    free(dev);
    free(host);
    return best / 1000;
}

int main(void) {
    printf("floor: mha 61-layer 1-row backup copy: %.2f us (122 rows of 2048 B); "
           "mla 61-layer 1-row backup copy: %.2f us (61 rows of 1152 B)\n",
           floor_us(2048, 2), floor_us(1152, 1));
    return 0;
}
