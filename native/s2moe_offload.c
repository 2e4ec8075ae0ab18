// s2moe expert prefetch: ask the OS to read exactly the byte ranges of chosen experts (madvise WILLNEED)
// in a read-only shared mapping of the model file.
//
// Why: when llama.cpp's mmap'd expert pages are not resident, each page fault makes the kernel read a
// whole read-around window (read_ahead_kb, often 128 KiB but up to MiBs) centred on the fault, which
// overfetches neighbouring experts and fills a tight memory budget with pages nobody asked for.
// madvise(WILLNEED) on the exact ranges starts the reads of what will be used, and only that.
// Called from Python before a verification (the draft's predicted experts), and small enough to be
// called from the routing hook the moment a layer's top-k ids are known.
//
// The same callback counts the experts that are not wholly in memory at that moment (mincore of their
// own ranges), so an offloaded verification knows how many of its experts had to be fetched without a
// walk over the whole mapping: on a model of tens of GiB that walk costs milliseconds per token.

#define _DEFAULT_SOURCE  // madvise and MADV_WILLNEED under -std=c11
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct s2_prefetch {
    uint8_t *base;        // start of our mapping of the model file
    size_t size;          // its length
    int n_layer, n_expert, n_parts;
    int64_t *ranges;      // [n_layer][n_expert][n_parts][2] (file offset, length); a copy
    uint8_t *mark;        // [n_expert] scratch: ids already advised in this call
    size_t page;
    int64_t n_calls, n_advised, bytes_advised;
    int advise;           // madvise(WILLNEED) the experts; 0: only count misses
    int32_t *misses;      // [n_layer] caller-owned: per layer, the distinct experts that were not wholly in
                          // memory when the layer's ids became final (NULL: not counted)
    unsigned char *vec;   // mincore scratch, one byte per page of the longest expert range
    const uint8_t *ahead; // [n_layer][n_expert] caller-owned: experts the coming decode is predicted to read
                          // (a verification's, from the draft); when layer L routes, layer L+1's are
                          // advised too, so that its reads overlap layer L's matmuls (NULL: none)
} s2_prefetch;

s2_prefetch *s2_prefetch_new(void *base, size_t size, int n_layer, int n_expert, int n_parts, const int64_t *ranges) {
    if (!base || n_layer <= 0 || n_expert <= 0 || n_parts <= 0 || !ranges) return NULL;
    s2_prefetch *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    const size_t n = (size_t)n_layer * n_expert * n_parts * 2;
    p->ranges = malloc(n * sizeof(int64_t));
    p->mark = calloc((size_t)n_expert, 1);
    if (!p->ranges || !p->mark) {
        free(p->ranges);
        free(p->mark);
        free(p);
        return NULL;
    }
    memcpy(p->ranges, ranges, n * sizeof(int64_t));
    p->base = base;
    p->size = size;
    p->n_layer = n_layer;
    p->n_expert = n_expert;
    p->n_parts = n_parts;
    p->advise = 1;
    long pg = sysconf(_SC_PAGESIZE);
    p->page = pg > 0 ? (size_t)pg : 4096;
    int64_t longest = 0;
    for (size_t i = 1; i < n; i += 2)
        if (ranges[i] > longest) longest = ranges[i];
    p->vec = malloc((size_t)longest / p->page + 2);
    if (!p->vec) {
        free(p->ranges);
        free(p->mark);
        free(p);
        return NULL;
    }
    return p;
}

void s2_prefetch_configure(s2_prefetch *p, int advise, int32_t *misses) {
    if (!p) return;
    p->advise = advise;
    p->misses = misses;
}

void s2_prefetch_set_ahead(s2_prefetch *p, const uint8_t *ahead) {
    if (p) p->ahead = ahead;
}

// The whole pages of part j (gate/up/down slice) of one expert: start offset and length in the mapping.
// Returns 0 for an empty or out-of-file range.
static int part_pages(const s2_prefetch *p, int layer, int e, int j, size_t *start, size_t *length) {
    const int64_t *r = p->ranges + (((size_t)layer * p->n_expert + e) * p->n_parts + j) * 2;
    const int64_t off = r[0], len = r[1];
    if (len <= 0 || off < 0 || (size_t)(off + len) > p->size) return 0;
    const size_t a = (size_t)off / p->page * p->page;
    const size_t b = ((size_t)(off + len) + p->page - 1) / p->page * p->page;
    *start = a;
    *length = (b > p->size ? p->size : b) - a;
    return 1;
}

// Whether every page of one expert of one layer is in the page cache. mincore on the expert's own
// ranges only: the cost follows the experts asked about, not the size of the model file.
// A part's first page is asked about first: under a budget most experts are out of memory, and the kernel's
// cost follows the pages asked about (a whole 1.7 MB expert took ~10 µs, its first page alone ~1 µs).
static int expert_resident(s2_prefetch *p, int layer, int e) {
    for (int j = 0; j < p->n_parts; ++j) {
        size_t a, n;
        if (!part_pages(p, layer, e, j, &a, &n)) continue;
        if (mincore(p->base + a, p->page, p->vec) != 0 || !(p->vec[0] & 1)) return 0;
        if (mincore(p->base + a, n, p->vec) != 0) return 0;
        for (size_t i = 0; i < (n + p->page - 1) / p->page; ++i)
            if (!(p->vec[i] & 1)) return 0;
    }
    return 1;
}

// The same for the routing hook (masked drafts ask about each candidate as its layer routes).
int s2_prefetch_expert_resident(void *p, int layer, int e) {
    s2_prefetch *q = p;
    if (!q || layer < 0 || layer >= q->n_layer || e < 0 || e >= q->n_expert) return 0;
    return expert_resident(q, layer, e);
}

// For each expert set in mask ([n_layer][n_expert], nonzero = ask), out = 1 if it is wholly resident.
// Returns how many of them are.
int s2_prefetch_resident(s2_prefetch *p, const uint8_t *mask, uint8_t *out) {
    if (!p || !mask || !out) return 0;
    int total = 0;
    for (int l = 0; l < p->n_layer; ++l)
        for (int e = 0; e < p->n_expert; ++e) {
            const size_t i = (size_t)l * p->n_expert + e;
            out[i] = mask[i] ? (uint8_t)expert_resident(p, l, e) : 0;
            total += out[i];
        }
    return total;
}

void s2_prefetch_free(s2_prefetch *p) {
    if (!p) return;
    free(p->ranges);
    free(p->mark);
    free(p->vec);
    free(p);
}

// madvise(WILLNEED) the ranges of the distinct experts among ids[0..n) of one layer (ids < 0 or out of
// range are ignored), first counting those not wholly in memory if misses are bound. Returns the number
// of distinct experts seen.
static int advise_layer(s2_prefetch *p, int layer, const int32_t *ids, int n, int count, int advise) {
    if (!p || layer < 0 || layer >= p->n_layer || !ids || n <= 0) return 0;
    memset(p->mark, 0, (size_t)p->n_expert);
    int advised = 0;
    for (int i = 0; i < n; ++i) {
        const int32_t e = ids[i];
        if (e < 0 || e >= p->n_expert || p->mark[e]) continue;
        p->mark[e] = 1;
        ++advised;
        if (count && !expert_resident(p, layer, e)) p->misses[layer]++;
        if (!advise) continue;
        for (int j = 0; j < p->n_parts; ++j) {
            size_t a, n;
            if (part_pages(p, layer, e, j, &a, &n) && madvise(p->base + a, n, MADV_WILLNEED) == 0)
                p->bytes_advised += (int64_t)n;
        }
    }
    p->n_calls++;
    p->n_advised += advised;
    return advised;
}

static int advise_predicted(s2_prefetch *p, int layer);

// The routing hook's callback: a layer's final ids, the moment before its expert matmuls read them.
int s2_prefetch_layer(s2_prefetch *p, int layer, const int32_t *ids, int n) {
    const int seen = advise_layer(p, layer, ids, n, p && p->misses != NULL, p && p->advise);
    if (p && p->advise && p->ahead && layer + 1 < p->n_layer) advise_predicted(p, layer + 1);
    return seen;
}

// WILLNEED the predicted experts of one layer that are not wholly resident yet.
static int advise_predicted(s2_prefetch *p, int layer) {
    int asked = 0;
    for (int e = 0; e < p->n_expert; ++e) {
        if (!p->ahead[(size_t)layer * p->n_expert + e] || expert_resident(p, layer, e)) continue;
        for (int j = 0; j < p->n_parts; ++j) {
            size_t a, n;
            if (part_pages(p, layer, e, j, &a, &n) && madvise(p->base + a, n, MADV_WILLNEED) == 0)
                p->bytes_advised += (int64_t)n;
        }
        ++asked;
    }
    return asked;
}

// The same for a [n_layer][n_expert] mask (nonzero = advise), e.g. a draft's predicted experts.
int s2_prefetch_mask(s2_prefetch *p, const uint8_t *mask) {
    if (!p || !mask) return 0;
    int total = 0;
    int32_t *ids = malloc((size_t)p->n_expert * sizeof(int32_t));
    if (!ids) return 0;
    for (int l = 0; l < p->n_layer; ++l) {
        int n = 0;
        for (int e = 0; e < p->n_expert; ++e)
            if (mask[(size_t)l * p->n_expert + e]) ids[n++] = e;
        if (n) total += advise_layer(p, l, ids, n, 0, 1);
    }
    free(ids);
    return total;
}

int64_t s2_prefetch_bytes(const s2_prefetch *p) { return p ? p->bytes_advised : 0; }
int64_t s2_prefetch_calls(const s2_prefetch *p) { return p ? p->n_calls : 0; }
